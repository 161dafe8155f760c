"""``.. mixprec-hf-fields::``: HF's other TrainingArguments fields, each with its default and what mixprec does
with it (implemented, ignored or refused, and why), read from the fields' own ``metadata["help"]``.

Those fields carry their one-line description in ``metadata["help"]`` (``"<policy>: <note>"``) rather than a
docstring, because ``HfArgumentParser`` shows that text as each flag's help.
"""

from __future__ import annotations

import dataclasses

from docutils import nodes
from docutils.parsers.rst import Directive
from sphinx.application import Sphinx


def rows() -> list[tuple[str, str, str, str]]:
    """(field, default, policy, note) for every field of HFCompatFields, in declaration order."""
    from mixprec.trainer.hf_fields import HFCompatFields

    out = []
    for f in dataclasses.fields(HFCompatFields):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        policy, _, note = f.metadata["help"].partition(": ")
        out.append((f.name, repr(default), policy, note))
    return out


def _cell(text: str, literal: bool = False) -> nodes.entry:
    entry = nodes.entry()
    para = nodes.paragraph()
    para += nodes.literal(text, text) if literal else nodes.Text(text)
    entry += para
    return entry


class HfFieldsTable(Directive):
    def run(self) -> list[nodes.Node]:
        # the page's width, split as the colspecs say (and docs/_static/mixprec.css): left to the browser, the
        # notes' long identifiers widened the table past the page and the notes column was cut off (issue 37)
        table = nodes.table(classes=["colwidths-given", "hf-fields"], width="100%")
        group = nodes.tgroup(cols=4)
        table += group
        for width in (30, 13, 13, 44):
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        row = nodes.row()
        for title in ("field", "default", "mixprec", "what it does, or why not"):
            row += _cell(title)
        head += row
        group += head
        body = nodes.tbody()
        for name, default, policy, note in rows():
            row = nodes.row()
            row += _cell(name, literal=True)
            row += _cell(default, literal=True)
            row += _cell(policy)
            row += _cell(note)
            body += row
        group += body
        return [table]


def setup(app: Sphinx) -> dict[str, object]:
    app.add_directive("mixprec-hf-fields", HfFieldsTable)
    return {"parallel_read_safe": True, "version": "1"}
