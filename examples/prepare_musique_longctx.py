"""Build a long-context RAG dataset for verl from MuSiQue: many retrieved paragraphs, one short answer.

Each question keeps its 20 MuSiQue paragraphs (2 to 4 of them support the answer) and gets distractor
paragraphs from other questions up to ``--total-paragraphs``, shuffled, so prompts reach tens of thousands
of tokens (about 116 Qwen2.5 tokens per paragraph: 200 paragraphs ~ 23k tokens). Answers are a few tokens:
the prompt-dominated regime of long-context RL, where replaying the prompt once per group pays most.

Output: ``train.parquet`` and ``test.parquet`` in verl's RL dataset format, scored by verl's built-in exact
match reward (``data_source="searchR1_musique"``: the last ``<answer>...</answer>`` of the response must
match the gold answer or an alias after normalisation).

    python examples/prepare_musique_longctx.py --input musique_ans_v1.0_train.jsonl --output ~/data/musique_longctx

``--input`` takes the official MuSiQue-Ans files (JSON lines) or a JSON list of the same records, such as
the 100-question sample in tests/data/musique_hipporag/musique_train.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

import pandas as pd

DATA_SOURCE = "searchR1_musique"
INSTRUCTION = (
    "Answer the question using the documents below. Think step by step if needed, then give only the final "
    "answer, as short as possible, between <answer> and </answer>."
)


def load_records(path: str) -> list[dict]:
    """MuSiQue records from a JSON list or a JSON-lines file; only answerable questions are kept."""
    text = Path(path).expanduser().read_text()
    records = (
        json.loads(text)
        if text.lstrip().startswith("[")
        else [json.loads(line) for line in text.splitlines() if line.strip()]
    )
    for i, rec in enumerate(records):
        missing = {"id", "paragraphs", "question", "answer"} - rec.keys()
        if missing:
            raise ValueError(f"record {i} of {path} lacks {sorted(missing)}; expected MuSiQue-Ans records")
    return [r for r in records if r.get("answerable", True)]


def build_prompt(record: dict, distractors: list[dict], rng: random.Random) -> str:
    paragraphs = list(record["paragraphs"]) + distractors
    rng.shuffle(paragraphs)
    documents = "\n\n".join(
        f"Document {k + 1} (Title: {p['title']})\n{p['paragraph_text']}" for k, p in enumerate(paragraphs)
    )
    return f"{INSTRUCTION}\n\n{documents}\n\nQuestion: {record['question']}"


def build_rows(records: list[dict], total_paragraphs: int, split: str, seed: int) -> list[dict]:
    """verl RL rows: chat prompt, data_source, gold answers for the reward, provenance in extra_info."""
    rng = random.Random(seed)
    pool = [(r["id"], p) for r in records for p in r["paragraphs"]]
    rows = []
    for index, record in enumerate(records):
        need = max(total_paragraphs - len(record["paragraphs"]), 0)
        others = [
            p for rid, p in rng.sample(pool, min(len(pool), need + len(record["paragraphs"]))) if rid != record["id"]
        ][:need]
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": build_prompt(record, others, rng)}],
                "ability": "long_context_qa",
                "reward_model": {
                    "style": "rule",
                    "ground_truth": {"target": [record["answer"], *record.get("answer_aliases", [])]},
                },
                "extra_info": {
                    "split": split,
                    "index": index,
                    "id": record["id"],
                    "num_paragraphs": len(record["paragraphs"]) + len(others),
                },
            }
        )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="MuSiQue-Ans records (JSON lines or a JSON list)")
    parser.add_argument("--output", default="~/data/musique_longctx", help="folder for train/test parquet")
    parser.add_argument(
        "--total-paragraphs",
        type=int,
        default=200,
        help="paragraphs per prompt, own 20 included (200 ~ 23k Qwen2.5 tokens)",
    )
    parser.add_argument("--test-fraction", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.total_paragraphs < 1:
        raise ValueError(f"--total-paragraphs must be >= 1, got {args.total_paragraphs}")
    if not 0 < args.test_fraction < 1:
        raise ValueError(f"--test-fraction must be in (0, 1), got {args.test_fraction}")

    records = load_records(args.input)
    random.Random(args.seed).shuffle(records)
    num_test = max(1, round(len(records) * args.test_fraction))
    out = Path(os.path.expanduser(args.output))
    out.mkdir(parents=True, exist_ok=True)
    for split, part, seed in (("test", records[:num_test], args.seed + 1), ("train", records[num_test:], args.seed)):
        rows = build_rows(part, args.total_paragraphs, split, seed)
        pd.DataFrame(rows).to_parquet(out / f"{split}.parquet")
        print(f"{split}: {len(rows)} prompts -> {out / f'{split}.parquet'}")


if __name__ == "__main__":
    main()
