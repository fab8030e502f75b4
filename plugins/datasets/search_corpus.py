"""A generated corpus with planted multi-hop facts, and the questions it answers.

The ``search`` environment's world, made in code from a seed (no download, nothing shipped):
people live in cities, cities lie in countries, countries speak languages. Each entity has one
document about it, so a question about a person needs one hop per link of the chain::

    city of kam olo?       -> tes   gold: the document about kam olo                    (1 hop)
    country of kam olo?    -> var   gold: kam olo's, then tes's                          (2 hops)
    language of kam olo?   -> lob   gold: kam olo's, tes's, then var's                   (3 hops)

Names are invented syllables (``kam``, ``olo``) so no model knows the answers beforehand, and
people share family names, so a search for ``kam olo`` also finds namesakes such as ``rin
olo``: documents that cost context and are worth pruning.

Two styles: ``tiny`` (one short sentence per document, identified by its title --
``kam olo: lives in tes.`` -- as multi-hop QA sets such as HotpotQA identify supporting
documents, so that citing is copying a name, which a character-level tiny model learns in
minutes; search results show whole documents) and ``full`` (numbered documents ``d007`` of a
few sentences with distracting facts; search results show a snippet and ``open`` reads the
rest). Splits are by person:
held-out questions ask about people no training question mentions (the corpus is shared, as
a search index is).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

STYLES = ("tiny", "full")
SPLITS = ("train", "val", "test")
#: Relation asked about -> hops from a person.
RELATIONS = {"city": 1, "country": 2, "language": 3}
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str


@dataclass
class Corpus:
    """Documents (in id order) and the question of every (person, hops) pair, by split."""

    documents: list[Document]
    questions: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    spec: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_id = {d.id: d for d in self.documents}
        if len(self.by_id) != len(self.documents):
            raise ValueError("corpus: two documents share an id")


def _names(rng: random.Random, count: int, taken: set[str], length: int) -> list[str]:
    """``count`` new invented words of ``length`` letters (consonant-vowel patterns), none a
    word the retriever drops as an English stopword."""
    from bm25s.stopwords import STOPWORDS_EN

    stop = set(STOPWORDS_EN)
    out: list[str] = []
    while len(out) < count:
        word = "".join(rng.choice(_CONSONANTS if i % 2 == 0 else _VOWELS) for i in range(length))
        if length == 3 and rng.random() < 0.5:  # vowel-first family names: olo, ide
            word = rng.choice(_VOWELS) + rng.choice(_CONSONANTS) + rng.choice(_VOWELS)
        if word not in taken and word not in stop:
            taken.add(word)
            out.append(word)
    return out


def generate(
    style: str = "tiny", seed: int = 0, people: int = 350, cities: int = 30, countries: int = 8, families: int = 40
) -> Corpus:
    """The corpus of ``style`` (see the module docstring); the same arguments give the same
    corpus, documents and questions."""
    if style not in STYLES:
        raise ValueError(f"search corpus: style must be one of {', '.join(STYLES)}, got '{style}'")
    if not (1 <= countries <= cities <= people and 1 <= families <= people):
        raise ValueError("search corpus: need 1 <= countries <= cities <= people and 1 <= families <= people")
    rng = random.Random(f"search-corpus-{seed}")
    taken: set[str] = set()
    country_names = _names(rng, countries, taken, 3)
    languages = _names(rng, countries, taken, 3)
    city_names = _names(rng, cities, taken, 3)
    family_names = _names(rng, families, taken, 3)
    first_names = _names(rng, people, taken, 3)
    city_country = {c: country_names[i % countries] for i, c in enumerate(city_names)}
    person = [(f"{first_names[i]} {rng.choice(family_names)}", rng.choice(city_names)) for i in range(people)]

    entities: list[tuple[str, str]] = []  # (title, text)
    for name, city in person:
        entities.append((name, _person_text(style, name, city, rng)))
    for city in city_names:
        entities.append((city, _city_text(style, city, city_country[city], rng)))
    for country, language in zip(country_names, languages):
        capital = next(c for c in city_names if city_country[c] == country)
        entities.append((country, _country_text(style, country, language, capital, rng)))
    order = list(range(len(entities)))
    rng.shuffle(order)  # ids say nothing about what a document is
    width = len(str(len(entities) - 1))  # fixed-width ids (d007): one length to copy
    doc_of = {entities[j][0]: entities[j][0] if style == "tiny" else f"d{i:0{width}d}" for i, j in enumerate(order)}
    documents = [Document(doc_of[entities[j][0]], *entities[j]) for j in order]

    language_of = dict(zip(country_names, languages))
    people_order = list(range(people))
    rng.shuffle(people_order)
    n_test = n_val = max(1, people // 7)
    split_of = {
        i: "test" if k < n_test else "val" if k < n_test + n_val else "train" for k, i in enumerate(people_order)
    }
    questions: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
    for i, (name, city) in enumerate(person):
        chain = [(name, city), (city, city_country[city]), (city_country[city], language_of[city_country[city]])]
        for relation, hops in RELATIONS.items():
            links = chain[:hops]
            questions[split_of[i]].append(
                {
                    "question": _question(style, relation, name),
                    "answer": links[-1][1],
                    "gold_ids": [doc_of[subject] for subject, _ in links],
                    "hops": hops,
                    "queries": [subject for subject, _ in links],  # the gold path: one search per hop
                }
            )
    spec = {
        "style": style,
        "seed": seed,
        "people": people,
        "cities": cities,
        "countries": countries,
        "families": families,
    }
    return Corpus(documents, questions, spec)


def _person_text(style: str, name: str, city: str, rng: random.Random) -> str:
    if style == "tiny":
        return f"lives in {city}."
    job = rng.choice(["baker", "pilot", "farmer", "painter", "teacher", "sailor", "doctor", "weaver"])
    year = rng.randint(1900, 2000)
    return f"{name} was born in {year} and works as a {job}. Today {name} lives in {city}, where {name} keeps bees."


def _city_text(style: str, city: str, country: str, rng: random.Random) -> str:
    if style == "tiny":
        return f"is in {country}."
    river = rng.choice(["a wide river", "two lakes", "an old bridge", "a busy port", "a hill fort"])
    return (
        f"{city} is known for {river} and {rng.randint(2, 90)} thousand people. The city of {city} lies in {country}."
    )


def _country_text(style: str, country: str, language: str, capital: str, rng: random.Random) -> str:
    if style == "tiny":
        return f"speaks {language}."
    return f"{country} is a country whose capital is {capital}. Most people in {country} speak {language}."


def _question(style: str, relation: str, name: str) -> str:
    if style == "tiny":
        return f"{relation} of {name}?"
    return {
        "city": f"In which city does {name} live?",
        "country": f"In which country does {name} live?",
        "language": f"Which language is spoken in the country where {name} lives?",
    }[relation]


@lru_cache(maxsize=8)
def _cached(style: str, seed: int, people: int, cities: int, countries: int, families: int) -> Corpus:
    return generate(style, seed, people, cities, countries, families)


def corpus_from_spec(spec: Any) -> Corpus:
    """A corpus from its spec: a mapping of :func:`generate`'s arguments (cached: every
    episode of a run shares one), or the path of a JSON-lines file of documents ``{"id",
    "title", "text"}`` -- your own corpus."""
    if isinstance(spec, str):
        return _from_file(spec)
    params = dict(spec or {})
    unknown = sorted(set(params) - {"style", "seed", "people", "cities", "countries", "families"})
    if unknown:
        raise ValueError(
            f"search corpus: unknown key(s) {', '.join(unknown)} (keys: style, seed, people, cities, "
            "countries, families; or a path to a documents JSONL file)"
        )
    full = {"style": "tiny", "seed": 0, "people": 350, "cities": 30, "countries": 8, "families": 40, **params}
    return _cached(str(full["style"]), *(int(full[k]) for k in ("seed", "people", "cities", "countries", "families")))


@lru_cache(maxsize=8)
def _from_file(path: str) -> Corpus:
    documents = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = [k for k in ("id", "text") if k not in row]
            if missing:
                raise ValueError(f"{path}:{n}: a document needs 'id' and 'text' (missing {', '.join(missing)})")
            documents.append(Document(str(row["id"]), str(row.get("title", "")), str(row["text"])))
    if not documents:
        raise ValueError(f"{path}: no documents")
    return Corpus(documents, spec={"path": path})
