"""Generate the three domains' Q&A files: ``data/<domain>/{train,val,test}.jsonl`` + ``data/meta.json``.

    python examples/domain_specialists/make_data.py          # rewrites data/ (deterministic)
    python examples/domain_specialists/make_data.py --check  # fails if data/ is stale

Every row is ``{"prompt": ..., "answer": ...}`` (the keys tempering's SFT/GRPO stages and the
``exact_match`` reward read); the domain is the file's folder. Answers are verifiable strings.

* ``arithmetic``: ``"23+45="`` -> ``"68"``, ``a, b`` in 0..49. Splits are disjoint sets of pairs.
* ``units``: ``"5 km in m="`` -> ``"5000"`` and back (``"5000 m in km="`` -> ``"5"``), powers-of-ten
  conversions of length, mass and volume, so every answer is an integer. Disjoint prompts.
* ``capitals``: ``"capital of France="`` -> ``"Paris"`` from ``countries.csv`` (100 countries,
  shipped with the ``capital_questions`` dataset: ``tempering.plugins.datasets``),
  each asked in four phrasings. A capital is a fact, not something a model can work out: a
  country never seen in training cannot be answered. So the split holds out *phrasings*: every
  country has two phrasings in train, one in val and one in test (which phrasing goes where is
  shuffled per country). The prompts of the three splits are disjoint; the facts are shared,
  and the test measures recall of a known fact asked in a new way.

The character set (``meta.json["chars"]``) is the union of every prompt and answer plus the
router prompt's prefix: the tiny models' character tokenizer is built from it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

from tempering.plugins.datasets.domain_questions import read_countries

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
DOMAINS = ("arithmetic", "units", "capitals")
SPLITS = ("train", "val", "test")
SEED = 20240808

#: The prompt the model router is trained on (see router.py).
ROUTER_PREFIX = "domain of: "

ARITH_MAX = 49
ARITH_SIZES = {"val": 150, "test": 200}  # the rest of the 2500 pairs is train

#: (small unit, big unit, big / small), all powers of ten.
UNIT_PAIRS = (
    ("mm", "cm", 10),
    ("cm", "m", 100),
    ("mm", "m", 1000),
    ("m", "km", 1000),
    ("mg", "g", 1000),
    ("g", "kg", 1000),
    ("ml", "l", 1000),
)
UNIT_MAX = 999
UNIT_SIZES = {"train": 1200, "val": 150, "test": 200}

CAPITAL_TEMPLATES = ("capital of {c}=", "{c} capital=", "capital city of {c}=", "{c} has capital=")


def arithmetic(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    pairs = [(a, b) for a in range(ARITH_MAX + 1) for b in range(ARITH_MAX + 1)]
    rng.shuffle(pairs)
    n_test, n_val = ARITH_SIZES["test"], ARITH_SIZES["val"]
    chunks = {"test": pairs[:n_test], "val": pairs[n_test : n_test + n_val], "train": pairs[n_test + n_val :]}
    return {s: [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in chunk] for s, chunk in chunks.items()}


def unit_questions() -> list[dict[str, str]]:
    """Every question of the domain: each pair both ways, each value 1..UNIT_MAX."""
    rows = []
    for small, big, factor in UNIT_PAIRS:
        for v in range(1, UNIT_MAX + 1):
            rows.append({"prompt": f"{v} {big} in {small}=", "answer": str(v * factor)})
            rows.append({"prompt": f"{v * factor} {small} in {big}=", "answer": str(v)})
    return rows


def units(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    rows = unit_questions()
    rng.shuffle(rows)
    out, start = {}, 0
    for split in ("test", "val", "train"):
        out[split] = rows[start : start + UNIT_SIZES[split]]
        start += UNIT_SIZES[split]
    return out


def capitals(rng: random.Random, countries: list[tuple[str, str]]) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = {s: [] for s in SPLITS}
    for country, capital in countries:
        order = list(CAPITAL_TEMPLATES)
        rng.shuffle(order)
        for split, templates in (("test", order[:1]), ("val", order[1:2]), ("train", order[2:])):
            out[split] += [{"prompt": t.format(c=country), "answer": capital} for t in templates]
    for rows in out.values():
        rng.shuffle(rows)
    return out


def generate() -> dict[str, dict[str, list[dict[str, str]]]]:
    """All splits of all domains, deterministically (one RNG per domain)."""
    return {
        "arithmetic": arithmetic(random.Random(f"{SEED}-arithmetic")),
        "units": units(random.Random(f"{SEED}-units")),
        "capitals": capitals(random.Random(f"{SEED}-capitals"), read_countries()),
    }


def charset(data: dict[str, dict[str, list[dict[str, str]]]]) -> str:
    chars = set(ROUTER_PREFIX) | {"="}
    for splits in data.values():
        for rows in splits.values():
            for r in rows:
                chars |= set(r["prompt"]) | set(r["answer"])
    for name in DOMAINS:  # the router's answers
        chars |= set(name)
    return "".join(sorted(chars))


def _jsonl(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows)


def render(data: dict[str, dict[str, list[dict[str, str]]]]) -> dict[str, str]:
    """Relative path -> file text, for every file under data/."""
    files = {f"{d}/{s}.jsonl": _jsonl(data[d][s]) for d in DOMAINS for s in SPLITS}
    meta = {
        "generator": "examples/domain_specialists/make_data.py",
        "seed": SEED,
        "chars": charset(data),
        "router_prefix": ROUTER_PREFIX,
        "counts": {d: {s: len(data[d][s]) for s in SPLITS} for d in DOMAINS},
        "max_answer_chars": max(len(r["answer"]) for splits in data.values() for rows in splits.values() for r in rows),
        "max_prompt_chars": max(len(r["prompt"]) for splits in data.values() for rows in splits.values() for r in rows),
    }
    files["meta.json"] = json.dumps(meta, indent=2) + "\n"
    return files


def write(out: Path = DATA) -> dict[str, str]:
    files = render(generate())
    for rel, text in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return files


def stale(out: Path = DATA) -> list[str]:
    """Files under ``out`` that differ from what the generator makes now."""
    return [
        rel
        for rel, text in render(generate()).items()
        if not (out / rel).exists() or (out / rel).read_text(encoding="utf-8") != text
    ]


def load_split(domain: str, split: str, data_dir: Path = DATA) -> list[dict[str, str]]:
    """Rows of one split, each with its ``domain`` added."""
    with open(data_dir / domain / f"{split}.jsonl", encoding="utf-8") as fh:
        return [{**json.loads(line), "domain": domain} for line in fh if line.strip()]


def load_meta(data_dir: Path = DATA) -> dict[str, Any]:
    return json.loads((data_dir / "meta.json").read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--check", action="store_true", help="exit 1 if the files under data/ are not what the generator makes"
    )
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        if bad:
            print(f"stale: {', '.join(bad)} (run {Path(__file__).name})", file=sys.stderr)
            return 1
        print("data/ is up to date")
        return 0
    files = write()
    total = sum(len(t.encode()) for t in files.values())
    meta = json.loads(files["meta.json"])
    print(f"wrote {len(files)} files, {total / 1024:.1f} KiB, {len(meta['chars'])} characters: {meta['counts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
