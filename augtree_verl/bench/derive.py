"""Derive the shipped workload length tables from the raw samples (offline, run once by maintainers).

    python -m augtree_verl.bench.derive --data-dir DATA_DIR   (the sample folders named in tables/ATTRIBUTION.md)

Tokenizes the samples with the Qwen2.5 tokenizer in ``<data-dir>/qwen2_5_tokenizer`` and writes one JSON per
regime into ``augtree_verl/bench/tables/``: ``{"workload", "source", "groups": [{"id", "prompt_len",
"response_lens"}]}`` in corpus order. The benchmark runtime reads only those tables (no tokenizer, no data dir).

How each regime's prompt and responses are formed (token counts as the policy sees them in RL):
- prompt: the user message rendered with the tokenizer's chat template plus the generation prompt
  (longdoc, rag, chat); reasoning prompts are the question plus the Sky-T1 system-prompt template overhead
  (``SKY_T1_TEMPLATE_TOKENS``, measured in ``length_tables/summary_stats.json``; the template text is not shipped).
- response: the answer's tokens plus one end-of-turn token (``<|im_end|>``); missing (empty) answers are dropped.
- longdoc: LongReward example, prompt = context + "\\n\\n" + query, responses = the 10 sampled answers (one group).
- rag: MuSiQue, prompt = 20 paragraphs ("title\\ntext") joined by blank lines + "\\n\\nQuestion: " + question,
  response = the gold answer (one per group).
- chat: Arena-Bench-v1, prompt = the user turn, responses = the first answer turn of each of the 18 models
  (model files in sorted name order).
- agent (``agent.json``, no groups: its user turns are chat's): the tiny-agents default system prompt and its
  two exit-loop tools (``huggingface_hub.inference._mcp.constants``, the package installed here) rendered as
  the system turn of the Qwen2.5 chat template with tools (the model tiny-agents defaults to is Qwen2.5-72B),
  and the template's own default system turn, which every chat prompt above starts with.
- reasoning: Sky-T1 32B long-CoT family (the 11 correct-5K-32B checkpoints and the corrupt/reflection variants)
  on AIME24 and AMC23. The sibling lengths come from ``length_tables/qwen2_5_token_lengths.csv`` (same
  tokenizer, raw text); the two traces shipped as text are re-tokenized here and must match that table.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

TABLES_DIR = Path(__file__).parent / "tables"
SKY_T1_TEMPLATE_TOKENS = 250  # summary_stats.json: "Sky-T1 ... reasoning system prompt ... 250 tokens"
END_OF_TURN_TOKENS = 1  # each RL response ends with <|im_end|>
REASONING_FAMILY = re.compile(r"^Sky-T1-math-(correct-5K-32B-ckpts/|corrupt-|reflection-)")
REASONING_SHIPPED = {  # shipped trace file -> (bench, model id in the length table)
    "aime24__Sky-T1-math-correct-5K-32B__checkpoint-140.jsonl": (
        "aime24",
        "Sky-T1-math-correct-5K-32B-ckpts/checkpoint-140",
    ),
    "amc23__Sky-T1-math-reflection-1.0-32B.jsonl": ("amc23", "Sky-T1-math-reflection-1.0-32B"),
}


class Counter:
    """Token counts with the Qwen2.5 tokenizer (raw text, no special tokens; prompts through the chat template)."""

    def __init__(self, tokenizer_dir: Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)

    def text(self, s: str) -> int:
        return len(self.tok(s, add_special_tokens=False)["input_ids"])

    def chat_prompt(self, user: str) -> int:
        return len(
            self._ids(
                self.tok.apply_chat_template(
                    [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=True
                )
            )
        )

    def response(self, s: str) -> int:
        return self.text(s) + END_OF_TURN_TOKENS

    def system_turns(self, system: str, tools: list[dict]) -> tuple[int, int]:
        """(tokens of the system turn ``system`` with ``tools``, tokens of the template's default system turn)."""
        ids = self._ids(
            self.tok.apply_chat_template([{"role": "system", "content": system}], tools=tools, tokenize=True)
        )
        user_only = self._ids(self.tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True))
        start = self.tok.convert_tokens_to_ids("<|im_start|>")
        return len(ids), [i for i, t in enumerate(user_only) if t == start][1]

    @staticmethod
    def _ids(ids) -> list[int]:
        return ids["input_ids"] if hasattr(ids, "keys") else ids


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def derive_longdoc(data: Path, count: Counter) -> list[dict]:
    sft = _jsonl(data / "longreward_example/sft.jsonl")[0]
    sampled = _jsonl(data / "longreward_example/sampled_responses.jsonl")
    sampled = sorted(
        (r for r in sampled if r["idx"].startswith(f"{sft['idx']}-")), key=lambda r: int(r["idx"].split("-")[1])
    )
    prompt = count.chat_prompt(sft["context"] + "\n\n" + sft["query"])
    return [
        {"id": str(sft["idx"]), "prompt_len": prompt, "response_lens": [count.response(r["answer"]) for r in sampled]}
    ]


def derive_rag(data: Path, count: Counter) -> list[dict]:
    groups = []
    for q in json.loads((data / "musique_hipporag/musique_train.json").read_text()):
        context = "\n\n".join(f"{p['title']}\n{p['paragraph_text']}" for p in q["paragraphs"])
        prompt = count.chat_prompt(context + "\n\nQuestion: " + q["question"])
        groups.append({"id": q["id"], "prompt_len": prompt, "response_lens": [count.response(q["answer"])]})
    return groups


def derive_chat(data: Path, count: Counter) -> list[dict]:
    answers: dict[str, list[str]] = {}
    for path in sorted((data / "arena_bench_v1/model_answer").glob("*.jsonl")):
        for rec in _jsonl(path):
            answers.setdefault(rec["question_id"], []).append(rec["choices"][0]["turns"][0])
    groups = []
    for q in _jsonl(data / "arena_bench_v1/question.jsonl"):
        resp = [count.response(a) for a in answers.get(q["question_id"], []) if a.strip()]
        groups.append({"id": q["question_id"], "prompt_len": count.chat_prompt(q["turns"][0]), "response_lens": resp})
    return groups


def derive_reasoning(data: Path, count: Counter) -> list[dict]:
    rows = list(csv.DictReader((data / "length_tables/qwen2_5_token_lengths.csv").open()))
    rows = [
        r
        for r in rows
        if r["source"] == "skythought"
        and REASONING_FAMILY.match(r["sample_id"])
        and r["group_id"].split(":")[0] in ("aime24", "amc23")
    ]
    _check_shipped_traces(data, count, rows)
    groups: dict[str, dict] = {}
    for r in rows:
        g = groups.setdefault(
            r["group_id"],
            {"id": r["group_id"], "prompt_len": int(r["prompt_tokens"]) + SKY_T1_TEMPLATE_TOKENS, "response_lens": []},
        )
        g["response_lens"].append(int(r["response_tokens"]) + END_OF_TURN_TOKENS)
    return list(groups.values())


def _check_shipped_traces(data: Path, count: Counter, rows: list[dict]) -> None:
    """The sibling table must agree with our own tokenization of the traces shipped as text."""
    table = {(r["group_id"], r["sample_id"]): (int(r["prompt_tokens"]), int(r["response_tokens"])) for r in rows}
    for name, (bench, model) in REASONING_SHIPPED.items():
        for rec in _jsonl(data / "skythought_long_cot" / name):
            ours = (count.text(rec["question"]), count.text(rec["code"][0]))
            theirs = table.get((f"{bench}:{rec['idx']}", model))
            if ours != theirs:
                raise ValueError(f"{name} idx {rec['idx']}: tokenized {ours} but the length table says {theirs}")


def derive_agent(count: Counter) -> dict:
    from huggingface_hub.inference._mcp.constants import DEFAULT_SYSTEM_PROMPT, EXIT_LOOP_TOOLS

    tools = json.loads(json.dumps(EXIT_LOOP_TOOLS))  # dict subclasses: plain dicts, as a client sends them
    system, default = count.system_turns(DEFAULT_SYSTEM_PROMPT, tools)
    return {"system_prompt_tokens": system, "default_system_tokens": default}


AGENT_SOURCE = (
    "tiny-agents default system prompt + exit-loop tools (huggingface_hub 1.33.0) as the Qwen2.5 "
    "system turn; user turns from chat"
)

REGIMES = {
    "longdoc": (derive_longdoc, "LongReward example (THUDM/LongReward), long-document QA, one real G=10 group"),
    "rag": (derive_rag, "MuSiQue-Ans train subset via HippoRAG, 20-paragraph RAG prompts, gold answers"),
    "chat": (derive_chat, "Arena-Bench-v1 (lmarena/arena-hard-auto), 300 prompts x 18 model answers"),
    "reasoning": (derive_reasoning, "Sky-T1 32B long-CoT traces (NovaSky-AI/SkyThought) on AIME24 and AMC23"),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, required=True, help="the shared data folder (has qwen2_5_tokenizer/)")
    parser.add_argument("--out-dir", type=Path, default=TABLES_DIR)
    args = parser.parse_args(argv)
    count = Counter(args.data_dir / "qwen2_5_tokenizer")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, (derive, source) in REGIMES.items():
        groups = derive(args.data_dir, count)
        path = args.out_dir / f"{name}.json"
        record = {"workload": name, "source": source, "groups": groups}
        path.write_text(json.dumps(record, separators=(",", ":")) + "\n")
        n = sum(len(g["response_lens"]) for g in groups)
        print(f"{name}: {len(groups)} groups, {n} responses -> {path}")
    agent = {"workload": "agent", "source": AGENT_SOURCE, **derive_agent(count)}
    (args.out_dir / "agent.json").write_text(json.dumps(agent, separators=(",", ":")) + "\n")
    print(f"agent: {agent['system_prompt_tokens']} system-turn tokens -> {args.out_dir / 'agent.json'}")


if __name__ == "__main__":
    main()
