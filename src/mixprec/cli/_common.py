"""What ``mixprec train``, ``diagnose`` and ``bench`` share: the --data/--model flags and what they build.

``add_data_model_args(parser)`` adds --data, --text-field, --model, --seq-len, --batch-size, --seed and
--precision; ``load_model_and_data(args)`` turns them into ``(model, train_dataset, eval_dataset, info)``:

- the model: a built-in GPT preset (``mixprec.models.GPT_PRESETS``: tiny, small, gpt2, gpt-1b), or a local Hugging
  Face model folder / ``config.json`` when transformers is installed (weights are loaded when the folder has
  them, else the model is initialised from the config). Nothing is ever downloaded: a name that is neither
  a preset nor an existing path is an error.
- the data: the embedded corpus (the Python standard library's source, ``mixprec.data.stdlib_corpus``) or
  --data (a text file, a folder of them, or JSONL), byte-tokenized, the last 10% held out for validation,
  cut into non-overlapping chunks of --seq-len tokens (``CausalLMDataset``).

Every mistake a user can make here raises :class:`CliError` (or FileNotFoundError/ValueError with a message
naming the flag), which the dispatcher prints as one line.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.accelerator.step_in_backward import fit_for_step_in_backward
from mixprec.cli._config_file import track_explicit
from mixprec.cli.main import CliError
from mixprec.data import VOCAB_SIZE, CausalLMDataset, load_corpus, unigram_entropy
from mixprec.models import GPT, GPT_PRESETS
from mixprec.precision.base import Precision
from mixprec.precision.op_policy import OP_KINDS
from mixprec.precision.registry import available_precisions, make_precision, policy_name
from mixprec.trainer.optimizers import OPTIMIZER_NAMES, TORCHAO_OPTIMIZERS, make_optimizer
from mixprec.watch.settings import WatchConfig

DEFAULT_MODEL = "small"
"""The built-in preset every subcommand uses without --model."""
DEFAULT_SEQ_LEN = 256
"""--seq-len when not given: this, or the model's block size if smaller."""
VAL_FRACTION = 0.1
"""Share of the corpus (its tail) held out for validation."""


def watch_setting(text: str) -> str:
    """argparse type: a --watch value the precision watch takes (refused now, in the flag's name)."""
    try:
        WatchConfig.parse(int(text) if text.lstrip("-").isdigit() else text, "--watch")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--watch: ")) from None
    return text


def _number(text: str, cast: type, expected: str, fits: Callable[[Any], bool]) -> Any:
    """The argparse types below: ``cast(text)`` when ``fits`` it, else "expected <expected>, got ..." (an
    integer shown as parsed, a number as typed)."""
    try:
        value = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not fits(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value if cast is int else text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    return _number(text, int, "a positive integer", lambda value: value > 0)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _number(text, float, "a positive number", lambda value: 0 < value < float("inf"))


def z_loss_weight(text: str) -> float:
    """argparse type for --z-loss: a number in [0, 1)."""
    return _number(text, float, "a number in [0, 1) such as 1e-4", lambda value: 0.0 <= value < 1.0)


PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".webp", ".eps", ".ps", ".tif", ".tiff")
"""What matplotlib writes, by the file's suffix (those ``savefig`` knows without a backend of its own)."""


def check_plot_file(flag: str, path: str) -> None:
    """Refuse, before any work, a plot file that cannot be written: its folder missing or not writable, the
    path itself a folder, or a suffix not among ``PLOT_SUFFIXES`` (a diagnosis or a bench is minutes of work to
    lose at the end)."""
    import os

    target = Path(path)
    if target.suffix.lower() not in PLOT_SUFFIXES:
        raise CliError(f"{flag} {path}: a plot is written as {', '.join(PLOT_SUFFIXES)}; e.g. {flag} {target.stem}.png")
    folder = target.parent  # "." for a bare file name
    if target.is_dir():
        raise CliError(f"{flag} {path}: that is a folder; name a file in it, e.g. {flag} {target / 'plot.png'}")
    if not folder.is_dir():
        raise CliError(
            f"{flag} {path}: the folder {folder} does not exist; create it first, or name a file in an existing folder"
        )
    if not os.access(folder, os.W_OK):
        raise CliError(f"{flag} {path}: the folder {folder} is not writable; name a file in a folder you can write")


def check_optimizer_fits(precision: Precision, optim: str) -> None:
    """Refuse an --optim the --precision cannot step with, before anything is loaded, in the command line's
    words: the precision's own verdict (``convert_optimizer`` on a one-element probe of that optimizer), and
    the flags that would fit (the Python refusal names classes and keyword arguments)."""
    if precision.pending or _refusal(precision, optim) is None:  # auto: decided at the first step
        return
    # torchao's optimizers are not probed for the advice: importing it takes seconds and prints its own lines
    offered = [name for name in OPTIMIZER_NAMES if name != optim and name not in TORCHAO_OPTIMIZERS]
    fits = [name for name in offered if _refusal(precision, name) is None]
    keep = [name for name in ("bf16", "fp32") if _refusal(make_precision(name, precision.device), optim) is None]
    ways = [f"--optim {' or '.join(fits)}"] if fits else []
    if keep:
        ways.append(f"--precision {keep[0]} to keep --optim {optim}")
    raise CliError(
        f"--precision {precision.name} --optim {optim}: {precision.name} steps the weights with its own "
        f"update, which {optim} cannot give; use " + ", or ".join(ways or ["another --optim"])
    )


def check_step_in_backward(precision: Precision, asked: str, processes: int) -> None:
    """Refuse --step-in-backward where it cannot run, in the command line's words: several processes (gradients
    are averaged after backward), a --precision that scales the loss ("auto" races without those modes)."""
    if processes > 1:
        raise CliError(
            f"--step-in-backward with {processes} processes: gradients are averaged across processes after "
            "backward; run it in one process, or drop --step-in-backward"
        )
    if not fit_for_step_in_backward(precision):
        raise CliError(
            f"--step-in-backward with --precision {asked}: fp16's loss scaling skips a step only once the whole "
            "backward is done; use bf16, bf16-pure or fp32 (--precision) with --step-in-backward"
        )


def _refusal(precision: Precision, optim: str) -> str | None:
    """Why ``precision`` refuses the optimizer ``optim`` names (None: it takes it, or it cannot be built here,
    e.g. torchao missing, which building it for the run then says in its own words)."""
    from types import SimpleNamespace

    probe = torch.nn.Parameter(torch.zeros(1, device=precision.device))
    cfg = SimpleNamespace(
        optim=optim, optim_args=None, learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8
    )
    try:
        optimizer = make_optimizer([{"params": [probe], "weight_decay": 0.0}], cfg)
    except Exception:  # noqa: BLE001 - not the precision's refusal: the run's own build reports it
        return None
    try:
        precision.convert_optimizer(optimizer)
    except ValueError as err:
        return str(err)
    return None


def _seq_len(text: str) -> int:
    value = positive_int(text)
    if value < 2:  # one token leaves no next-token target after the shift
        raise argparse.ArgumentTypeError(f"must be at least 2, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _number(text, int, "an integer >= 0", lambda value: value >= 0)


MAX_SEED = 2**64 - 1
"""torch's generators take a 64-bit seed; a larger one fails deep inside torch.manual_seed."""


def seed_int(text: str) -> int:
    """argparse type: an integer from 0 to 2**64 - 1 (what torch.manual_seed accepts)."""
    value = nonnegative_int(text)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be at most 2**64 - 1 = {MAX_SEED} (a 64-bit seed), got {value}")
    return value


def add_data_model_args(
    parser: argparse.ArgumentParser,
    *,
    batch_size: int = 16,
    precision: str | None = "auto",
    seed: int = 42,
    seq_len: int = DEFAULT_SEQ_LEN,
) -> None:
    """Add --data, --text-field, --model, --seq-len, --batch-size, --seed and --precision to ``parser``.

    The keyword arguments are this subcommand's defaults (``seq_len`` is capped at the model's block size;
    ``precision=None`` leaves out --precision).
    Flags added here are tracked for ``--config`` (see ``mixprec.cli._config_file``), so a subcommand may add
    ``--config`` too.
    """
    track_explicit(parser)
    presets = ", ".join(GPT_PRESETS)
    group = parser.add_argument_group("model and data")
    group.add_argument(
        "--data",
        metavar="PATH",
        default=None,
        help="a text file, a folder of text files, or a .jsonl file (one JSON object per line); "
        "default: the embedded corpus (this Python's standard library source, no download)",
    )
    group.add_argument(
        "--text-field", metavar="NAME", default="text", help="field holding the text in a .jsonl file (default: text)"
    )
    group.add_argument(
        "--model",
        metavar="NAME|PATH",
        default=DEFAULT_MODEL,
        help=f"a built-in GPT ({presets}; default: {DEFAULT_MODEL}) or a local Hugging Face model folder or "
        f"config.json (needs transformers; nothing is downloaded)",
    )
    group.add_argument(
        "--seq-len",
        metavar="N",
        type=_seq_len,
        default=None,
        help=f"tokens (bytes) per training sequence (default: {seq_len}, or the model's block size if smaller)",
    )
    group.add_argument(
        "--batch-size",
        metavar="N",
        type=positive_int,
        default=batch_size,
        help=f"sequences per step (default: {batch_size})",
    )
    group.add_argument("--seed", metavar="N", type=seed_int, default=seed, help=f"random seed (default: {seed})")
    parser.set_defaults(_default_seq_len=seq_len)  # not a flag: what load_model_and_data uses without --seq-len
    if precision is None:  # a subcommand that compares precisions (bench) has its own flag for them
        return
    meaning = {"auto": "the fastest safe one for this device, with the reason printed"}.get(precision, "")
    group.add_argument(
        "--precision",
        metavar="NAME",
        default=precision,
        help=f"{', '.join(available_precisions())} (default: {precision}{': ' + meaning if meaning else ''})",
    )
    group.add_argument(
        "--fp32-ops",
        metavar="KIND[,KIND]",
        default=None,
        help=f"op kinds kept in fp32 under a bf16/fp16 --precision ({', '.join(OP_KINDS)}), e.g. attention; "
        "the same as --precision bf16:fp32_ops=attention",
    )


def parse_precision(name: str, fp32_ops: str | None = None) -> Precision:
    """The one parse of --precision (``--fp32-ops`` folded in): the strategy the command runs, made for the
    default device (the Accelerator binds it to this process's device) and handed down as it is; its
    ``name`` is canonical ("fp32", "fp16", "bf16", "auto", "bf16:fp32_ops=attention"). CliError naming the
    flag for an unknown name (listing the valid ones) or a mode this machine cannot run."""
    try:
        return make_precision(policy_name(name, fp32_ops))
    except (TypeError, ValueError) as exc:
        raise CliError(f"--{'fp32-ops' if fp32_ops else 'precision'}: {exc}") from None


@dataclass(frozen=True)
class DataModelInfo:
    """What was built, for the run header, the saved config and the summary."""

    model: str
    """--model as given: a preset name or a path."""
    model_description: str
    """One line: "built-in GPT 'small' (4 layers, 128 wide, 0.82M parameters)"."""
    num_parameters: int
    block_size: int
    """Longest sequence the model accepts."""
    seq_len: int
    corpus: str
    """One line from the corpus loader: where the text came from and how big it is."""
    train_tokens: int
    val_tokens: int
    unigram_baseline: float
    """Entropy (nats/byte) of the validation split's own byte distribution: the best loss any model that
    ignores context can reach there. Learning means going well below it."""
    precision: str
    """Canonical name as asked ("auto" stays "auto"; what it resolves to is the Trainer's to say)."""
    builtin: bool
    """True for a mixprec GPT preset, False for a Hugging Face model."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _hf_block_size(config: Any) -> int | None:
    for name in ("n_positions", "max_position_embeddings", "n_ctx", "block_size"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _build_hf_model(path: Path, dtype: torch.dtype | None = None) -> tuple[nn.Module, int, str]:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ModuleNotFoundError:
        raise CliError(
            f"--model {path}: a Hugging Face model needs transformers (pip install 'mixprec[hf]'); "
            f"built-in models: {', '.join(GPT_PRESETS)}"
        ) from None
    if path.is_dir() and not (path / "config.json").is_file():
        raise CliError(f"--model {path}: the folder has no config.json (a Hugging Face model folder needs one)")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        detail = " ".join(str(exc).split())[:300]
        raise CliError(f"--model {path}: not a usable Hugging Face config ({detail})") from None
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < VOCAB_SIZE:
        raise CliError(
            f"--model {path}: vocab_size {vocab} is smaller than the {VOCAB_SIZE} byte ids of the corpus; "
            f"use a config with vocab_size >= {VOCAB_SIZE}"
        )
    has_weights = path.is_dir() and any(
        (path / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
    )
    try:
        held = {} if dtype is None else {"dtype": dtype}  # loaded straight in it: no fp32 copy on the way
        if has_weights:
            model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **held)
        else:
            model = AutoModelForCausalLM.from_config(config, **held)
    except (OSError, ValueError, KeyError) as exc:
        detail = " ".join(str(exc).split())[:300]
        raise CliError(f"--model {path}: cannot build a causal LM from it ({detail})") from None
    block = _hf_block_size(config)
    if block is None:
        raise CliError(f"--model {path}: the config states no maximum sequence length (n_positions)")
    how = "weights loaded" if has_weights else "initialised from its config"
    n = sum(p.numel() for p in model.parameters())
    desc = f"Hugging Face {type(model).__name__} from {path} ({how}, {n / 1e6:.2f}M parameters)"
    return model, block, desc


def build_model(name: str, seed: int, dtype: torch.dtype | None = None) -> tuple[nn.Module, int, str, bool]:
    """``(model, block_size, description, builtin)`` for --model; parameters initialised from ``seed``.
    ``dtype``: a Hugging Face model's parameters, as loaded (``--lora-r``'s frozen base); default fp32."""
    # the model is built before the Trainer seeds anything, so seed here for a reproducible init
    torch.manual_seed(seed)
    if name in GPT_PRESETS:
        model = GPT.from_preset(name)
        cfg = model.config
        desc = (
            f"built-in GPT {name!r} ({cfg.n_layer} layers, {cfg.n_embd} wide, {cfg.n_head} heads, "
            f"{model.num_parameters() / 1e6:.2f}M parameters)"
        )
        return model, cfg.block_size, desc, True
    path = Path(name).expanduser()
    if not path.exists():
        raise CliError(
            f"--model {name!r}: not a built-in model ({', '.join(GPT_PRESETS)}) and no such local folder or "
            f"file (nothing is downloaded)"
        )
    model, block, desc = _build_hf_model(path, dtype)
    return model, block, desc, False


def load_model_and_data(
    args: argparse.Namespace, dtype: torch.dtype | None = None, precision: Precision | None = None
) -> tuple[nn.Module, CausalLMDataset, CausalLMDataset, DataModelInfo]:
    """Build the model and the (train, validation) datasets that ``args`` (from :func:`add_data_model_args`)
    describe (a Hugging Face model loaded in ``dtype`` when given). ``precision``: the command's strategy
    when it parsed --precision already (else parsed here); ``info.precision`` holds its name. Reads the corpus
    from disk; no device work. Raises CliError/FileNotFoundError/ValueError with a one-line message for every
    input problem."""
    if precision is None:
        precision = parse_precision(getattr(args, "precision", "auto"), getattr(args, "fp32_ops", None))
    model_name = getattr(args, "model", DEFAULT_MODEL)
    seed = getattr(args, "seed", 42)
    # data first: a wrong --data path is reported before any model is built
    corpus = load_corpus(getattr(args, "data", None), text_field=getattr(args, "text_field", "text"))
    model, block, desc, builtin = build_model(model_name, seed, dtype)
    seq_len = getattr(args, "seq_len", None)
    if seq_len is None:
        seq_len = min(getattr(args, "_default_seq_len", DEFAULT_SEQ_LEN), block)
    elif seq_len > block:
        raise CliError(
            f"--seq-len {seq_len} is larger than the block size {block} of the model {model_name!r} "
            f"(the longest sequence it accepts); use --seq-len {block} or less"
        )
    train_tokens, val_tokens = corpus.split(VAL_FRACTION)
    train = CausalLMDataset(train_tokens, seq_len, split="training split")
    val = CausalLMDataset(val_tokens, seq_len, split=f"validation split (the last {VAL_FRACTION:.0%} of the corpus)")
    info = DataModelInfo(
        model=model_name,
        model_description=desc,
        num_parameters=sum(p.numel() for p in model.parameters()),
        block_size=block,
        seq_len=seq_len,
        corpus=corpus.source,
        train_tokens=len(train_tokens),
        val_tokens=len(val_tokens),
        unigram_baseline=unigram_entropy(val_tokens),
        precision=precision.name,
        builtin=builtin,
    )
    return model, train, val, info
