"""The extractor finds exactly the commands a reader would run, and nothing else.

If it silently found nothing, or dropped a block, test_commands.py would pass
without testing the docs; these pin down the convention it documents.
"""

from __future__ import annotations

from pathlib import Path

from tests.docs.markdown import console_commands, examples

DOC = """\
# A page

```sh
make run    # no temporal command: not an example
```

1. Start:

   ```sh
   .venv/bin/temporal workflow start --type ProxyLifecycle \\
       --workflow-id proxy-demo --input '{"provider": "local"}'
   ```

   <!-- docs-test: wait proxy-demo Ready -->
   ```sh
   curl "$(temporal workflow query --workflow-id proxy-demo --name status)"
   ```

<!-- docs-test: wait proxy-demo Ready -->
Prose in between drops a directive.

<!-- docs-test: skip needs a real cluster -->
```sh
temporal operator namespace create --namespace proxies --address cluster.example:7233
```

```python
temporal workflow start  # another language: not run
```

<!-- docs-test: each-on-fresh proxy-eu-1 -->
| command | what |
| --- | --- |
| `temporal workflow cancel --workflow-id proxy-eu-1` | cancels; `not a command` |
| `temporal workflow signal ... --name terminate` | terminates |

```console
$ temporal workflow result \\
    --workflow-id proxy-bad
Results:
  Status   FAILED
$ temporal workflow list
```
"""


def test_examples_are_the_temporal_blocks_and_tables_in_order(tmp_path: Path) -> None:
    doc = tmp_path / "docs" / "page.md"
    doc.parent.mkdir()
    doc.write_text(DOC)
    found = examples(doc, tmp_path)
    assert [(e.source, e.kind) for e in found] == [
        ("docs/page.md:9", "sh"),
        ("docs/page.md:15", "sh"),
        ("docs/page.md:23", "sh"),
        ("docs/page.md:32", "each-on-fresh"),
        ("docs/page.md:37", "console"),
    ]
    start, curl, cluster, table, console = found
    # De-indented out of the list item, continuation kept for bash.
    assert start.text.startswith(".venv/bin/temporal workflow start --type ProxyLifecycle \\\n")
    assert start.directives == ()
    assert curl.directive("wait") == ["proxy-demo", "Ready"]
    assert table.directive("each-on-fresh") == ["proxy-eu-1"]
    assert table.text.splitlines() == [
        "temporal workflow cancel --workflow-id proxy-eu-1",
        "temporal workflow signal ... --name terminate",
    ]
    assert cluster.directives == ("skip needs a real cluster",)
    assert console.directives == ()


def test_a_console_transcript_is_commands_and_the_output_each_shows() -> None:
    transcript = "$ temporal workflow result \\\n    --workflow-id x\n"
    transcript += "Results:\n\n  Status   FAILED\n$ temporal workflow list\n"
    assert console_commands(transcript) == [
        ("temporal workflow result     --workflow-id x", ["Results:", "  Status   FAILED"]),
        ("temporal workflow list", []),
    ]


def test_the_blocks_of_a_language_are_found_with_their_directives(tmp_path: Path) -> None:
    doc = tmp_path / "page.md"
    doc.write_text(DOC + "\n<!-- docs-test: python -->\n```python\nprint(1)\n```\n")
    first, second = examples(doc, tmp_path, language="python")
    assert (first.source, first.directives) == ("page.md:27", ())
    assert first.text == "temporal workflow start  # another language: not run\n"
    assert (second.source, second.kind, second.text) == ("page.md:46", "python", "print(1)\n")
    assert second.directives == ("python",)
