"""What counts as a documented command or snippet (tests/doc_snippets.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests import doc_snippets

DOC = """# Title

Run it:

```sh
nodescope check                 # watch the node for 3 s
# a whole-line comment

cp a b \\
   c/    # continued
echo "a # not a comment" x#y
```

1. In a list:

   ```bash
   apt-get install ./x.deb
   ```

```console
$ sinfo -R
REASON  NODELIST
$ scontrol show node n1 | grep Reason   # the reason
```

Paragraph text.
$ nodescope alerts --json

```
plain output, no prompt
```

```toml
[alerts]
for_seconds = 1.0
```

```json
"hardware": {"base": "dgx-h100"}
```
"""


def test_commands_of_each_form_in_document_order() -> None:
    found = doc_snippets.commands("docs/x.md", DOC)
    assert [(c.line, c.text) for c in found] == [
        (6, "nodescope check"),
        (9, "cp a b c/"),
        (11, 'echo "a # not a comment" x#y'),
        (17, "apt-get install ./x.deb"),
        (21, "sinfo -R"),
        (23, "scontrol show node n1 | grep Reason"),
        (27, "nodescope alerts --json"),
    ]
    # A block's commands share its opening line; a prompt in a paragraph has none.
    assert [c.block for c in found] == [5, 5, 5, 16, 20, 20, 0]
    assert {c.doc for c in found} == {"docs/x.md"}


def test_snippets_by_language_with_their_opening_line() -> None:
    toml = doc_snippets.snippets("d.md", DOC, frozenset({"toml"}))
    assert [(s.line, s.text) for s in toml] == [(33, "[alerts]\nfor_seconds = 1.0\n")]


def test_a_prompt_with_only_a_comment_is_no_command() -> None:
    assert doc_snippets.commands("d.md", "$ # nothing\n```console\n$ #\n```\n") == []


def test_an_unclosed_block_runs_to_the_end() -> None:
    assert doc_snippets.blocks("```sh\nls\n") == [doc_snippets.Block("sh", 1, ("ls",))]


def test_a_longer_fence_holds_a_shorter_one() -> None:
    text = "````md\n```sh\nls\n```\n````\n"
    assert doc_snippets.commands("d.md", text) == []
    assert doc_snippets.blocks(text) == [doc_snippets.Block("md", 1, ("```sh", "ls", "```"))]


@pytest.mark.parametrize(
    ("line", "kept"),
    [
        ("ls   # list", "ls"),
        ("# only a comment", ""),
        ("echo '#' \"#\"", "echo '#' \"#\""),
        ("echo ${#x} a#b", "echo ${#x} a#b"),
        ("curl -s http://h:1/metrics#frag", "curl -s http://h:1/metrics#frag"),
    ],
)
def test_strip_comment(line: str, kept: str) -> None:
    assert doc_snippets.strip_comment(line) == kept


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ('{"a": 1}', {"a": 1}),
        ('"hardware": {"base": "x"}', {"hardware": {"base": "x"}}),
        ('{"kind": "a"},\n{"kind": "b"},', [{"kind": "a"}, {"kind": "b"}]),
        ('{"kind": "a", "l": [{"x": 1}, {"y": 2}]}', {"kind": "a", "l": [{"x": 1}, {"y": 2}]}),
    ],
)
def test_json_fragment(text: str, value: object) -> None:
    assert doc_snippets.json_fragment(text) == value


def test_json_fragment_refuses_what_is_not_json() -> None:
    with pytest.raises(ValueError, match="not JSON"):
        doc_snippets.json_fragment("key = 1")


@given(st.text(max_size=400))
def test_any_text_extracts_without_error(text: str) -> None:
    for command in doc_snippets.commands("d.md", text):
        assert command.text == command.text.strip()
        assert command.text
        assert "\n" not in command.text
