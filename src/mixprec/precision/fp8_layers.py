"""Which ``nn.Linear`` layers fp8 converts: the one filter behind :meth:`Fp8Precision.convert_module`.

fp8 pays only where a matmul is large enough for its faster tensor cores to outweigh the casts to fp8 and the
scale computations around it (issue 28: fp8 + compile ran at 0.88x bf16 + compile on GPT-2 124M, 1.06x on a
0.91B GPT). A layer stays in bf16 when:

- it is the model itself (torchao would return a new object; callers hold the old one);
- a dimension is not a multiple of 16 (the fp8 matmul's hardware rule);
- it is the output head (its weight tied to an embedding, or named ``lm_head`` / ``output``): its logits feed
  the softmax and the loss, where fp8's 3-bit mantissa costs accuracy, as torchtitan leaves its "output" out;
- it is small for the recipe: torchao's thresholds from its H100 benchmarks (``torchao.float8``'s
  ``_auto_filter_for_recipe``): tensorwise converts unless K <= 4096 and N <= 1024; rowwise only when N > 2048,
  K > 1024 and not (N <= 4096 and K <= 2048), K the input and N the output features. On GPT-2 124M (width
  768) tensorwise converts the attention's input projection and the MLP's first layer, rowwise nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

FP8_ALIGNMENT = 16  # torchao's (and cuBLASLt's) rule for fp8 matmul shapes
HEAD_NAMES = ("lm_head", "output")  # HF's and torchtitan's name of the output projection
RECIPES = ("tensorwise", "rowwise")


@dataclass(frozen=True)
class Fp8LayerFilter:
    """Why a Linear layer stays in bf16 under fp8, or "" when it is converted."""

    recipe: str = "tensorwise"
    """torchao's scaling recipe: the size thresholds depend on it."""
    skip_small: bool = True
    """Leave layers below the recipe's size thresholds in bf16 (False: convert every aligned layer)."""
    skip_head: bool = True
    """Leave the output head in bf16."""

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"Fp8LayerFilter(recipe={self.recipe!r}): choose one of {', '.join(RECIPES)}")

    def why_not(self, fqn: str, layer: nn.Linear, embedding_weights: set[int] = frozenset()) -> str:
        """The reason ``layer`` (at ``fqn`` in its model) stays in bf16, or "". ``embedding_weights``: ids of the
        model's embedding weights (:func:`embedding_weight_ids`), to recognise a tied head."""
        if fqn == "":
            return "the model itself is a Linear: wrap it in a module to convert it"
        k, n = layer.in_features, layer.out_features
        shape = f"{k}x{n}"
        if k % FP8_ALIGNMENT or n % FP8_ALIGNMENT:
            return f"{shape}: fp8 needs both dimensions divisible by {FP8_ALIGNMENT}"
        if self.skip_head and (id(layer.weight) in embedding_weights or fqn.rsplit(".", 1)[-1] in HEAD_NAMES):
            return f"{shape}: the output head (its logits feed the softmax; fp8 there costs accuracy)"
        if self.skip_small and self._small(k, n):
            return f"{shape}: too small for {self.recipe} fp8 to beat bf16 (torchao's H100 thresholds)"
        return ""

    def _small(self, k: int, n: int) -> bool:
        if self.recipe == "tensorwise":
            return k <= 4096 and n <= 1024
        return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def embedding_weight_ids(model: nn.Module) -> set[int]:
    """ids of the weights of ``model``'s embeddings (a head tied to one is the output head)."""
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
