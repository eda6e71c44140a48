"""The text corpus: a few hundred inputs written for this project (announcements, prices, times,
dates, phone numbers, addresses, units, weather, traffic, control tokens; Chinese, English and
mixed) and what the box must say for each, in ``tests/text/*.tsv``.

Each row is normalized with the full 21,178-entry vocabulary of the official tokenizer layout,
as the daemon does, and compared exactly: text said and characters reported unspeakable.
"""

from pathlib import Path

import pytest

from appliance.build.random_ckpt import build_vocab, write_tokenizer
from appliance.text.normalize import Normalizer
from appliance.text.tokenizer import Tokenizer

CORPUS = Path(__file__).parent / "text"


def load_corpus() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """Rows of every ``tests/text/*.tsv``: (id, input, said, unspeakable)."""
    rows = []
    for f in sorted(CORPUS.glob("*.tsv")):
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip() or line.startswith("#"):
                continue
            cols = line.split("\t")
            assert len(cols) in (3, 4), f"{f.name}:{n}: want 3 or 4 tab-separated columns, got {len(cols)}"
            kind, text, said = cols[:3]
            unspeakable = tuple(cols[3].split()) if len(cols) == 4 else ()
            rows.append((f"{f.stem}:{n}:{kind}", text.replace("\\n", "\n"), said, unspeakable))
    return rows


ROWS = load_corpus()


def make_full_tokenizer(d: Path) -> Tokenizer:
    """The official layout's full vocabulary (bert-base-chinese sized, 21,128 + 50 control tokens)."""
    write_tokenizer(d, build_vocab("full"))
    return Tokenizer.from_dir(d)


@pytest.fixture(scope="module")
def norm(tmp_path_factory):
    return Normalizer(make_full_tokenizer(tmp_path_factory.mktemp("full_tok")))


def test_corpus_size():
    assert len(ROWS) >= 300
    kinds = {r[0].split(":")[2] for r in ROWS}
    assert {"announce", "price", "time", "date", "phone", "address", "unit", "weather", "traffic",
            "control", "script", "symbol", "mixed", "markup", "url", "number"} <= kinds


@pytest.mark.parametrize("rid, text, said, unspeakable", ROWS, ids=[r[0] for r in ROWS])
def test_corpus(norm, rid, text, said, unspeakable):
    r = norm(text)
    assert (r.text, r.unspeakable) == (said, unspeakable)
