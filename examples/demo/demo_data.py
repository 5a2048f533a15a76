"""Data stage of the demo build: bundled prompt sets and the target's training set.

Reads the licensed sets in /work/shared/data (schema in its MANIFEST.md) and writes
examples/demo/data/. CodeAlpaca (CC BY-NC 4.0) is never read. Every choice is seeded
(`SEED`), so two runs give byte-identical files.

Run: `python examples/demo/build_demo.py --stage data` (see build_demo.py --help).

Splits, all disjoint by prompt text:
  * math: a seeded sample of 500 GSM8K test items -> gsm8k_test_prompts (prompt
    only); its first 300 -> prompts_math (with the reference solution). A seeded
    permutation of GSM8K train
    gives train_target (first GSM8K_TARGET) and gsm8k_train_prompts (the next
    GSM8K_PROMPTS, prompt only: the target never trained on them, like the test
    prompts). MathQA test subset (1000) -> train_target (problem+options -> rationale).
  * code: MBPP test (task 11-510) -> prompts_code (300, seeded); MBPP train,
    validation and prompt splits (474) -> train_target (text+tests -> code).
  * prose: first user turns of ShareGPT (both files) and Spec-Bench's MT-Bench chat
    (both turns), qa, summarization (the article) and rag (the passages) items.
    Items that look like code or are not mostly ASCII letters are dropped. 300
    short-to-medium prompts (ShareGPT, MT-Bench chat turn 1, qa) go to prompts_prose;
    the rest become continuation documents in train_target (see `_continuations`).
    Spec-Bench math/coding items (its GSM8K items are GSM8K test) and translation
    items (German source text) are not used.

Prose documents. The prose sources have no responses, so each text (cut into chunks
of at most PROSE_CHUNK_CHARS at paragraph/sentence/word boundaries, of which the
first PROSE_MAX_CHUNKS are kept) is split near a third of its length at a sentence or
word boundary: the first part is the prompt, the rest the response. Half of the
documents (seeded coin) prefix the prompt with "Continue the text:\\n\\n"; the other
half give the bare first part, so that a bare prose prompt (as in prompts_prose) is
answered in prose.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

SEED = 20240601
DEFAULT_SHARED = Path("/work/shared/data")
SIZE_CAP = 4_500_000  # bytes, the whole data folder
N_PROMPTS = 300  # per domain, prompts_{prose,math,code}
N_GSM8K_TEST = 500  # gsm8k_test_prompts; prompts_math is its first N_PROMPTS
GSM8K_TARGET = 1900  # GSM8K train items in train_target
GSM8K_PROMPTS = 1200  # GSM8K train prompts in gsm8k_train_prompts
PROSE_CHUNK_CHARS = 1000
PROSE_MAX_CHUNKS = 1
PROSE_MIN_CHARS = 40
PROSE_HOLDOUT_CHARS = (30, 800)  # length range of prompts_prose prompts
CONTINUE_INSTRUCTION = "Continue the text:\n\n"
# Where each shared set came from and its license; commits and paths come from
# shared/data/index.json at build time.
LICENSES = {
    "gsm8k": "MIT License (c) 2021 OpenAI",
    "mathqa": "MIT License (c) 2024 Zhibin Gou (harness); MathQA itself Apache-2.0",
    "mbpp": "MIT License (c) 2023 DeepSeek (repo); MBPP itself CC-BY-4.0",
    "sharegpt": "Apache License 2.0 (ml-energy/leaderboard-v2; upstream apache-2.0)",
    "spec_bench": "Apache License 2.0 (hemingkx/Spec-Bench)",
}
_CODE_LINE = re.compile(
    r"\s*(import |from \S+ import |def |class |#include|public |private |function |"
    r"const |let |var |return |SELECT |<[a-zA-Z/]|//|if ?\(|for ?\(|\$ )"
)


@dataclass
class DataBuild:
    """Everything the data stage writes, before serialization."""

    files: dict[str, list[dict]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # lines for ATTRIBUTION.md


def _load(shared: Path, rel: str) -> list[dict]:
    with open(shared / rel, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _clean(text: str) -> str:
    text = text.replace("\\_", "_").replace("\\*", "*").replace("\r\n", "\n")
    text = "\n".join(line.rstrip() for line in text.strip().splitlines())
    return re.sub(r"\n{3,}", "\n\n", text)


def _is_prose(text: str) -> bool:
    """English-looking text that is not code, markup or a log."""
    if "```" in text or len(text) < 2:
        return False
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) / len(letters) < 0.97:
        return False
    lines = [ln for ln in text.splitlines() if ln.strip()]
    code_lines = sum(
        bool(_CODE_LINE.match(ln)) or ln.rstrip().endswith((";", "{", "}", ")"))
        for ln in lines
    )
    if code_lines >= 2 or code_lines / max(1, len(lines)) > 0.2:
        return False
    symbols = sum(text.count(c) for c in "{}[]();=<>_\\|$#@")
    return symbols / len(text) < 0.03 and len(letters) / len(text) > 0.6


def _split_at(text: str, frac: float) -> int:
    """A sentence end (else a space) near `frac` of `text`; 0 if none fits."""
    target = int(len(text) * frac)
    ends = [m.end() for m in re.finditer(r"[.!?:;]\s+|\n+", text)]
    ends = [e for e in ends if 0.15 * len(text) <= e <= 0.6 * len(text)]
    if ends:
        return min(ends, key=lambda e: abs(e - target))
    spaces = [m.start() for m in re.finditer(r" ", text)]
    spaces = [s for s in spaces if 0.1 * len(text) <= s <= 0.6 * len(text)]
    return min(spaces, key=lambda s: abs(s - target)) if spaces else 0


def _chunks(text: str) -> list[str]:
    """Consecutive pieces of at most PROSE_CHUNK_CHARS, cut at natural boundaries."""
    pieces = []
    for piece in re.split(r"(?<=\n)|(?<=[.!?] )", text):
        while len(piece) > PROSE_CHUNK_CHARS:  # no sentence boundary: cut at a space
            cut = piece.rfind(" ", 0, PROSE_CHUNK_CHARS)
            cut = cut if cut > 0 else PROSE_CHUNK_CHARS
            pieces.append(piece[:cut])
            piece = piece[cut:]
        pieces.append(piece)
    out, cur = [], ""
    for piece in pieces:
        if cur and len(cur) + len(piece) > PROSE_CHUNK_CHARS:
            out.append(cur)
            cur = ""
        cur += piece
    out.append(cur)
    return [c.strip() for c in out if len(c.strip()) >= PROSE_MIN_CHARS]


def _continuations(item_id: str, text: str, rng: random.Random) -> list[dict]:
    docs = []
    for k, chunk in enumerate(_chunks(text)[:PROSE_MAX_CHUNKS]):
        cut = _split_at(chunk, 1 / 3)
        head, tail = chunk[:cut].strip(), chunk[cut:].strip()
        if not head or not tail:
            continue
        prefix = CONTINUE_INSTRUCTION if rng.random() < 0.5 else ""
        docs.append({"id": f"{item_id}#{k}", "prompt": prefix + head, "response": tail})
    return docs


def _prose_items(shared: Path) -> list[dict]:
    """Deduplicated prose items: {id, source, texts, holdout_ok}."""
    items, seen = [], set()

    def add(item_id: str, source: str, texts: list[str], holdout_ok: bool) -> None:
        texts = [_clean(t) for t in texts if t and t.strip()]
        if not texts or not all(_is_prose(t) for t in texts):
            return
        key = _norm(texts[0])
        if key in seen:
            return
        seen.add(key)
        items.append(
            {"id": item_id, "source": source, "texts": texts, "holdout_ok": holdout_ok}
        )

    for rel in [
        "sharegpt/v3_filtered_500.jsonl",
        "sharegpt/sg90k_part1_first_turns.jsonl",
    ]:
        for r in _load(shared, rel):
            add(r["id"], "sharegpt", [r["prompt"]], True)
    for r in _load(shared, "spec_bench/test.jsonl"):
        cat = r["category"]
        if r["domain"] == "chat":
            add(r["id"], "spec_bench", r["turns"], True)
        elif cat == "qa":
            add(r["id"], "spec_bench", [r["prompt"]], True)
        elif cat == "summarization":
            add(r["id"], "spec_bench", [r["prompt"].removeprefix("Summarize: ")], False)
        elif cat == "rag":
            add(r["id"], "spec_bench", [r["prompt"]], False)
    return items


def _prose(build: DataBuild, train: list[dict], shared: Path) -> None:
    rng = random.Random(SEED)
    items = _prose_items(shared)
    lo, hi = PROSE_HOLDOUT_CHARS
    eligible = [
        it for it in items if it["holdout_ok"] and lo <= len(it["texts"][0]) <= hi
    ]
    holdout = rng.sample(eligible, N_PROMPTS)
    held = {it["id"] for it in holdout}
    build.files["prompts_prose.jsonl"] = [
        {"id": it["id"], "domain": "prose", "prompt": it["texts"][0]}
        for it in sorted(holdout, key=lambda it: it["id"])
    ]
    n_docs = Counter()
    for it in items:
        if it["id"] in held:
            continue
        for t, text in enumerate(it["texts"]):
            for doc in _continuations(f"{it['id']}.t{t}", text, rng):
                train.append({**doc, "domain": "prose"})
                n_docs[it["source"]] += 1
    build.notes.append(
        f"prose: {len(items)} ShareGPT/Spec-Bench items kept after filtering and "
        f"dedup; {len(holdout)} of the {len(eligible)} with a first text of {lo}-{hi} "
        f"characters (ShareGPT, MT-Bench chat turn 1, Spec-Bench qa) -> seeded -> "
        f"prompts_prose; the rest -> continuation documents in train_target ("
        + ", ".join(f"{k} {v}" for k, v in sorted(n_docs.items()))
        + ")."
    )


def _math(build: DataBuild, train: list[dict], shared: Path) -> None:
    rng = random.Random(SEED + 1)
    test = _load(shared, "gsm8k/test.jsonl")
    order = rng.sample(range(len(test)), N_GSM8K_TEST)
    build.files["prompts_math.jsonl"] = [
        {
            "id": test[i]["id"],
            "domain": "math",
            "prompt": test[i]["prompt"],
            "response": test[i]["reference"],
            "final_answer": test[i]["final_answer"],
        }
        for i in sorted(order[:N_PROMPTS])
    ]
    build.files["gsm8k_test_prompts.jsonl"] = [
        {"id": test[i]["id"], "domain": "math", "prompt": test[i]["prompt"]}
        for i in sorted(order)
    ]
    # The rest of GSM8K test: with gsm8k_test_prompts and gsm8k_train_prompts, a
    # long math phase without repeats (online adaptation).
    build.files["gsm8k_more_prompts.jsonl"] = [
        {"id": test[i]["id"], "domain": "math", "prompt": test[i]["prompt"]}
        for i in sorted(set(range(len(test))) - set(order))
    ]
    gtrain = _load(shared, "gsm8k/train.jsonl")
    order = list(range(len(gtrain)))
    rng.shuffle(order)
    train.extend(_pair(gtrain[i], "math") for i in sorted(order[:GSM8K_TARGET]))
    build.files["gsm8k_train_prompts.jsonl"] = [
        {"id": gtrain[i]["id"], "domain": "math", "prompt": gtrain[i]["prompt"]}
        for i in sorted(order[GSM8K_TARGET : GSM8K_TARGET + GSM8K_PROMPTS])
    ]
    mathqa = _load(shared, "mathqa/test.jsonl")
    train.extend(_pair(r, "math") for r in mathqa)
    build.notes.append(
        f"math: GSM8K test {len(test)} -> {N_GSM8K_TEST} seeded -> "
        f"gsm8k_test_prompts, whose first {N_PROMPTS} (same seeded order) -> "
        f"prompts_math; the other {len(test) - N_GSM8K_TEST} -> gsm8k_more_prompts. "
        f"GSM8K train {len(gtrain)} -> seeded permutation: "
        f"{GSM8K_TARGET} -> train_target, the next {GSM8K_PROMPTS} -> "
        f"gsm8k_train_prompts (disjoint; the other "
        f"{len(gtrain) - GSM8K_TARGET - GSM8K_PROMPTS} left out for the size cap). "
        f"MathQA test subset {len(mathqa)} -> train_target (all)."
    )


def _code(build: DataBuild, train: list[dict], shared: Path) -> None:
    rng = random.Random(SEED + 2)
    test = _load(shared, "mbpp/test.jsonl")
    picked = sorted(rng.sample(range(len(test)), N_PROMPTS))
    build.files["prompts_code.jsonl"] = [
        {
            "id": test[i]["id"],
            "domain": "code",
            "prompt": test[i]["prompt"],
            "response": test[i]["reference"],
        }
        for i in picked
    ]
    n = 0
    rest = []
    for split in ["train", "validation", "prompt"]:
        for r in _load(shared, f"mbpp/{split}.jsonl"):
            train.append(_pair(r, "code"))
            rest.append(r)
            n += 1
    # A longer code phase (online adaptation): the other MBPP prompts, test split
    # first (the target never saw those); serve it after prompts_code.
    build.files["mbpp_more_prompts.jsonl"] = [
        {"id": r["id"], "domain": "code", "prompt": r["prompt"]}
        for r in [test[i] for i in sorted(set(range(len(test))) - set(picked))] + rest
    ]
    build.notes.append(
        f"code: MBPP test {len(test)} -> {N_PROMPTS} seeded -> prompts_code "
        f"(the other {len(test) - N_PROMPTS} -> mbpp_more_prompts); MBPP "
        f"train+validation+prompt {n} -> train_target (all) and mbpp_more_prompts "
        f"(after the test ones; prompts_code + mbpp_more_prompts = all of MBPP, "
        f"a long code stream without repeats)."
    )


def _pair(r: dict, domain: str) -> dict:
    return {
        "id": r["id"],
        "domain": domain,
        "prompt": r["prompt"],
        "response": r["reference"],
    }


def _source(record_id: str) -> str:
    """The shared set a bundled record came from, read off its id."""
    parts = record_id.split("-")
    return "-".join(parts[:2]) if parts[0] in ("gsm8k", "sharegpt") else parts[0]


def collect(shared: Path = DEFAULT_SHARED) -> DataBuild:
    """Build every bundled file in memory (deterministic) from the shared sets."""
    build, train = DataBuild(), []
    _math(build, train, shared)
    _code(build, train, shared)
    _prose(build, train, shared)
    build.files["train_target.jsonl"] = train
    _check_disjoint(build.files)
    return build


def _check_disjoint(files: dict[str, list[dict]]) -> None:
    train_prompts = {_norm(r["prompt"]) for r in files["train_target.jsonl"]}
    train_text = "\n".join(
        _norm(r["prompt"] + " " + r["response"]) for r in files["train_target.jsonl"]
    )
    for name, rows in files.items():
        if name in ("train_target.jsonl", "gsm8k_train_prompts.jsonl"):
            continue
        if name == "mbpp_more_prompts.jsonl":  # holds train_target's MBPP on purpose
            continue
        clash = [r["id"] for r in rows if _norm(r["prompt"]) in train_prompts]
        assert not clash, f"{name}: prompts also in train_target: {clash[:5]}"
        if name == "prompts_prose.jsonl":
            inside = [r["id"] for r in rows if _norm(r["prompt"]) in train_text]
            assert not inside, f"{name}: prompt text inside train_target: {inside[:5]}"
    test = {_norm(r["prompt"]) for r in files["gsm8k_test_prompts.jsonl"]}
    both = [
        r["id"]
        for r in files["gsm8k_train_prompts.jsonl"]
        if _norm(r["prompt"]) in test
    ]
    assert not both, f"gsm8k train/test prompt overlap: {both[:5]}"


def _dumps(row: dict) -> str:
    return json.dumps(row, ensure_ascii=False, separators=(",", ":"))


def _attribution(build: DataBuild, sizes: dict[str, int], shared: Path) -> str:
    index = json.loads((shared / "index.json").read_text())
    lines = [
        "# Bundled demo data: sources, licenses, counts",
        "",
        "Written by `python examples/demo/build_demo.py --stage data` from the",
        "converted public sets in the project's shared data folder (each taken from a",
        "public GitHub repository pinned to a commit; see the table). Selection is",
        f"seeded (seed {SEED}); two runs give byte-identical files. CodeAlpaca",
        "(CC BY-NC 4.0) is not used. License texts are in `licenses/`, copied",
        "unchanged.",
        "",
        "| set | source (repo@commit:path) | license | license file |",
        "| --- | --- | --- | --- |",
    ]
    for name, lic in LICENSES.items():
        srcs = sorted({s for e in index[name].values() for s in e["sources"]})
        src = "<br>".join(f"`{s.removeprefix('github:')}`" for s in srcs)
        files = ", ".join(
            f"`licenses/{f.name}`"
            for f in sorted((shared / name / "licenses").iterdir())
        )
        lines.append(f"| {name} | {src} | {lic} | {files} |")
    counts = {
        n: Counter(_source(r["id"]) for r in rows) for n, rows in build.files.items()
    }
    lines += ["", "## Files", "", "| file | records | bytes | by source |"]
    lines.append("| --- | ---: | ---: | --- |")
    for n, rows in build.files.items():
        by = ", ".join(f"{k} {v}" for k, v in sorted(counts[n].items()))
        lines.append(f"| `{n}` | {len(rows)} | {sizes[n]} | {by} |")
    lines += ["", "## What was taken", ""]
    lines += [f"- {note}" for note in build.notes]
    lines += [
        "- Fields: `id` (the shared-data id; prose documents add `.t<turn>#<chunk>`),",
        "  `domain` (prose, math or code), `prompt`, and `response` where the",
        "  source has a reference (GSM8K answer with its `<<...>>` calculator notes",
        "  and `#### N` line; MathQA rationale; MBPP code). prompts_math adds",
        "  `final_answer`. The source set is the id's prefix.",
        "- MBPP prompts are `text` + the three test asserts; MathQA prompts are the",
        "  problem + its options (the shared-data conversion); the MBPP tests to run",
        "  are the `assert` lines of the prompt.",
        "- Prose documents are made, not sourced: ShareGPT/Spec-Bench texts have no",
        "  responses, so each text chunk is split near a third; the first part is",
        "  the prompt (half of them prefixed with `Continue the text:`), the rest",
        "  the response. Texts are cleaned (markdown `\\_`/`\\*` unescaped, trailing",
        "  spaces and extra blank lines removed) and filtered (code-like or not",
        "  mostly ASCII letters: dropped; exact duplicates: dropped). Only the first",
        f"  chunk of at most {PROSE_CHUNK_CHARS} characters of each text is used",
        "  (cut at a sentence or line boundary). Spec-Bench summarization items",
        "  give their article, rag items their passages and question, MT-Bench",
        "  items both turns; Spec-Bench translation, math and coding items are not",
        "  used (German text; math/code are covered by GSM8K/MathQA/MBPP, and",
        "  Spec-Bench's math_reasoning items are GSM8K test items).",
        "- No file overlaps: no held-out prompt appears in train_target (checked by",
        "  normalized text; prose prompts also as a substring), and",
        "  gsm8k_train_prompts shares no prompt with gsm8k_test_prompts.",
        f"- Size cap {SIZE_CAP:,} bytes for this folder: GSM8K train and test are",
        "  subsampled (seeded) and prose texts are cut to their first chunk, as",
        "  stated above; MathQA and MBPP train/validation/prompt are complete.",
        "",
        "ShareGPT prompts are user-shared ChatGPT conversations (first user turn",
        "only); OpenAI's terms on model outputs may also apply to them. Spec-Bench",
        "compiles MT-Bench, CNN/DailyMail, Natural Questions and DPR items, whose own",
        "licenses apply to those items.",
        "",
    ]
    return "\n".join(lines)


def write(
    out_dir: Path, build: DataBuild, shared: Path = DEFAULT_SHARED
) -> dict[str, int]:
    """Write the JSONL files, licenses and ATTRIBUTION.md; returns bytes per file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for name, rows in build.files.items():
        text = "".join(_dumps(r) + "\n" for r in rows)
        (out_dir / name).write_text(text, encoding="utf-8")
        sizes[name] = len(text.encode("utf-8"))
    lic_dir = out_dir / "licenses"
    lic_dir.mkdir(exist_ok=True)
    for name in LICENSES:
        for lic in sorted((shared / name / "licenses").iterdir()):
            shutil.copyfile(lic, lic_dir / lic.name)
    (out_dir / "ATTRIBUTION.md").write_text(
        _attribution(build, sizes, shared), encoding="utf-8"
    )
    total = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    assert total < SIZE_CAP, f"data folder is {total} bytes, cap {SIZE_CAP}"
    return sizes
