"""The generated CPU-loop task: verl's dataset loads it with the model's own tokenizer; its reward varies."""

from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from transformers import AutoConfig, AutoTokenizer
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.utils.reward_score import default_compute_score

from augtree_verl.cpu_loop.environment import keyword_feedback
from augtree_verl.cpu_loop.reward import DATA_SOURCE, compute_score
from augtree_verl.cpu_loop.task import KEYS_PER_PROMPT, TOOL, TaskConfig, main, task_rows

REPO = Path(__file__).resolve().parents[2]
SMALL = dict(train_rows=6, test_rows=2, min_words=100, max_words=200, max_positions=512)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    out = tmp_path_factory.mktemp("cpu-loop")
    main(["--out", str(out), *[f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]])
    return out


def test_verls_dataset_tokenizes_the_prompts_into_known_words(task, tmp_path):
    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base=None):
        data_config = compose(
            config_name="grpo_augtree", overrides=[f"+data.cache_dir={tmp_path}", "data.max_prompt_length=1024"]
        ).data
    tokenizer = AutoTokenizer.from_pretrained(task / "model")
    train = RLHFDataset(str(task / "data/train.parquet"), tokenizer, data_config)
    assert len(train) == SMALL["train_rows"]
    ids = tokenizer.apply_chat_template(
        train[0]["raw_prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenizer.unk_token_id not in ids
    assert SMALL["min_words"] < len(ids) < SMALL["max_words"] + KEYS_PER_PROMPT + 16
    assert tokenizer.decode(ids).startswith("<|im_start|> user key ")
    keys = train[0]["reward_model"]["ground_truth"]  # the task's tool gets them as verl passes a row's tools_kwargs
    assert train[0]["tools_kwargs"] == {TOOL: {"create_kwargs": {"keys": keys}}}
    config = AutoConfig.from_pretrained(task / "model")
    assert config.vocab_size == len(tokenizer) and config.max_position_embeddings == SMALL["max_positions"]


def test_reward_is_the_fraction_of_key_words(task):
    row = pd.read_parquet(task / "data/train.parquet").iloc[0]
    keys = row["reward_model"]["ground_truth"].split()
    assert row["data_source"] == DATA_SOURCE and len(keys) == KEYS_PER_PROMPT
    gold = row["reward_model"]["ground_truth"]
    assert compute_score(DATA_SOURCE, f"{keys[0]} {keys[1]} zu", gold) == pytest.approx(2 / 3)
    assert compute_score(DATA_SOURCE, "", gold) == 0.0


def test_agent_rows_share_one_system_prompt_and_the_environment_marks_key_words():
    config = TaskConfig(**SMALL, system_words=50)
    rows = task_rows(3, config, split="train", seed=1) + task_rows(1, config, split="test", seed=2)
    systems = {row["prompt"][0]["content"] for row in rows}
    assert len(systems) == 1 and len(systems.pop().split()) == 50
    assert [m["role"] for m in rows[0]["prompt"]] == ["system", "user"]
    assert [m["role"] for m in task_rows(1, TaskConfig(**SMALL), split="train", seed=1)[0]["prompt"]] == ["user"]
    key = rows[0]["reward_model"]["ground_truth"].split()[0]
    other = next(w for w in ("ba", "be", "bi") if w not in rows[0]["reward_model"]["ground_truth"])
    reply = keyword_feedback([{"role": "assistant", "content": f"{key} {other} {key}"}], rows[0])
    assert reply == "key text key"


def test_other_data_sources_keep_verls_reward():
    gold = {"target": ["Paris"]}
    assert (
        compute_score("searchR1_musique", "<answer>Paris</answer>", gold)
        == default_compute_score("searchR1_musique", "<answer>Paris</answer>", gold)
        == 1.0
    )


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(max_words=10, min_words=20), "max_words"),
        (dict(train_rows=0), "train_rows"),
        (dict(max_positions=100), "max_positions"),
        (dict(hidden_size=40), "hidden_size"),
        (dict(system_words=-1), "system_words"),
        (dict(system_words=1500), "system_words=1500"),
    ],
)
def test_bad_sizes_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        TaskConfig(**bad)
