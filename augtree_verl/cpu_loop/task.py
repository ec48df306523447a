"""A tiny model and a long-prompt task for running verl's RL loop on CPU, generated (no download).

- The tokenizer is word-level over a fixed vocabulary (80 syllable words, a few task words, Qwen's chat
  tokens) with a Qwen-style chat template, so verl's dataset and agent loop tokenize prompts as usual. Its
  words include the task tool's (``cpu_loop.tools``): ``call <word>`` calls it, its replies have the role ``tool``.
- The model is a Llama-architecture GQA model with random weights (seeded), small enough that a training
  step takes seconds. Not Qwen: transformers 5 loads a qwen2 checkpoint with Qwen's BPE tokenizer class
  whatever tokenizer the directory holds, and verl's agent loop expects Qwen's exact chat tokens for qwen
  model types; for llama it uses its generic token builder.
- The task: each prompt names 8 key words, then a long text of random words (``min_words`` to
  ``max_words``), then asks for an answer; the reward (``reward.compute_score``) is the fraction of answer
  words that are key words. Rows are verl's RL format: ``prompt`` (chat messages), ``data_source``,
  ``reward_model.ground_truth``, ``extra_info`` (with the key words for the task's tool, ``cpu_loop.tools``,
  in ``tools_kwargs``). With ``system_words`` > 0 every row starts with the same
  system message of that many words (seeded), so the batch shares one long prefix across prompts, as
  agents' system prompts and tool schemas do (the multi-turn agent task: ``examples/train_agent.sh``).

``python -m augtree_verl.cpu_loop.task --out DIR`` writes ``DIR/model`` (a Hugging Face model directory with
its tokenizer) and ``DIR/data/{train,test}.parquet``.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

from augtree_verl.cpu_loop.reward import DATA_SOURCE

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
TOOL, CALL = "check", "call"  # the task's tool and the word that calls it: ``call <word>`` (cpu_loop.tools)
TASK_WORDS = ["system", "user", "assistant", "tool", "key", "text", "answer", CALL]
WORDS = [c + v for c in "bdfghjklmnprstvz" for v in "aeiou"]
KEYS_PER_PROMPT = 8
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} {{ message['content'] }} "
    "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def require_positive(config, names: tuple[str, ...]) -> None:
    """Refuse a size below 1 among ``names`` of ``config``, naming it."""
    for name in names:
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(config, name)}")


@dataclass(frozen=True)
class TaskConfig:
    """Sizes of the generated model and data; validated on construction."""

    train_rows: int = 64
    test_rows: int = 8
    min_words: int = 256
    max_words: int = 768
    hidden_size: int = 64
    num_layers: int = 2
    max_positions: int = 2048
    system_words: int = 0
    seed: int = 0

    def __post_init__(self):
        require_positive(self, ("train_rows", "test_rows", "min_words", "hidden_size", "num_layers"))
        if self.system_words < 0:
            raise ValueError(f"system_words must be >= 0, got {self.system_words}")
        if self.max_words < self.min_words:
            raise ValueError(f"max_words ({self.max_words}) must be >= min_words ({self.min_words})")
        if self.hidden_size % 16:
            raise ValueError(f"hidden_size must be a multiple of 16 (4 heads of 16 x k), got {self.hidden_size}")
        # prompt = key words + text + a few task and chat tokens; the answer needs room too
        if self.max_positions < self.system_words + self.max_words + KEYS_PER_PROMPT + 64:
            raise ValueError(
                f"max_positions ({self.max_positions}) leaves no room for prompts of "
                f"system_words={self.system_words} + max_words={self.max_words}"
            )


def build_tokenizer():
    """The word-level tokenizer with its chat template (a ``PreTrainedTokenizerFast``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + TASK_WORDS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="[UNK]",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_model(directory: Path, config: TaskConfig) -> Path:
    """A random-weight Llama-architecture GQA model with the tokenizer, saved as a Hugging Face model directory."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    model_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=2 * config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=config.max_positions,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(config.seed)
    model = LlamaForCausalLM(model_config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def task_rows(num_rows: int, config: TaskConfig, *, split: str, seed: int) -> list[dict]:
    """``num_rows`` verl RL rows of the key-word task (see the module docstring)."""
    rng = random.Random(seed)
    system_text = " ".join(random.Random(config.seed).choices(WORDS, k=config.system_words))
    system = [{"role": "system", "content": system_text}] if config.system_words else []
    rows = []
    for index in range(num_rows):
        keys = rng.sample(WORDS, KEYS_PER_PROMPT)
        text = rng.choices(WORDS, k=rng.randint(config.min_words, config.max_words))
        content = f"key {' '.join(keys)} text {' '.join(text)} answer"
        messages = system + [{"role": "user", "content": content}]
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": messages,
                "ability": "keywords",
                "reward_model": {"style": "rule", "ground_truth": " ".join(keys)},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "words": len(text),
                    "tools_kwargs": {TOOL: {"create_kwargs": {"keys": " ".join(keys)}}},
                },
            }
        )
    return rows


def write_splits(data_dir: Path, splits: dict[str, list[dict]]) -> Path:
    """Each split's rows as verl-format parquet, ``data_dir/<split>.parquet``; returns ``data_dir``."""
    import pandas as pd

    data_dir.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        pd.DataFrame(rows).to_parquet(data_dir / f"{split}.parquet")
    return data_dir


def write_task(out: Path, config: TaskConfig = TaskConfig()) -> tuple[Path, Path]:
    """Write ``out/model`` and ``out/data/{train,test}.parquet``; returns (model dir, data dir)."""
    out = Path(out)
    model_dir = save_model(out / "model", config)
    splits = {
        "train": task_rows(config.train_rows, config, split="train", seed=config.seed),
        "test": task_rows(config.test_rows, config, split="test", seed=config.seed + 1),
    }
    return model_dir, write_splits(out / "data", splits)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="output directory (model/ and data/)")
    defaults = TaskConfig()
    names = ("train_rows", "test_rows", "min_words", "max_words", "max_positions", "system_words", "seed")
    for name in names:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    args = parser.parse_args(argv)
    config = TaskConfig(**{name: getattr(args, name) for name in names})
    model_dir, data_dir = write_task(args.out, config)
    print(f"model: {model_dir}\ndata: {data_dir}")


if __name__ == "__main__":
    main()
