"""examples/prepare_musique_longctx.py writes data verl's RL dataset loads and verl's built-in reward scores."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from transformers import AutoTokenizer
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.utils.reward_score import default_compute_score

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
MUSIQUE_SAMPLE = DATA / "musique_hipporag" / "musique_train.json"  # 100 questions, official format
# The questions prepared here: verl's dataset tokenizes every prompt (~14k tokens each) to filter the long ones.
QUESTIONS = 20
TOKENIZER = str(DATA / "qwen2_5_tokenizer")
PARAGRAPHS = 120  # ~14k tokens: long, but quick to tokenize here


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("musique_longctx")
    sample = out / "musique_sample.json"
    sample.write_text(json.dumps(json.loads(MUSIQUE_SAMPLE.read_text())[:QUESTIONS]))
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples/prepare_musique_longctx.py"),
            "--input",
            str(sample),
            "--output",
            str(out),
            "--total-paragraphs",
            str(PARAGRAPHS),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    return out


@pytest.mark.timeout(300)
def test_verls_dataset_loads_long_prompts_within_the_recipe_limit(prepared, tmp_path):
    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base=None):
        # The filter in this process: verl's default (1 worker) forks a pool from the test process, whose threads
        # (the background e2e runs, the tokenizer's) once left the forked worker hung for the test's 300 s.
        overrides = [f"+data.cache_dir={tmp_path}", "data.filter_overlong_prompts_workers=0"]
        data_config = compose(config_name="grpo_augtree", overrides=overrides).data
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    train = RLHFDataset(str(prepared / "train.parquet"), tokenizer, data_config)
    test = RLHFDataset(str(prepared / "test.parquet"), tokenizer, data_config)
    assert (len(train), len(test)) == (19, 1)  # nothing over max_prompt_length was filtered out
    row = train[0]
    assert row["data_source"] == "searchR1_musique" and row["extra_info"]["num_paragraphs"] == PARAGRAPHS
    assert row["raw_prompt"][0]["role"] == "user" and "<answer>" in row["raw_prompt"][0]["content"]
    lengths = [
        len(
            tokenizer.apply_chat_template(
                train[i]["raw_prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for i in range(5)
    ]
    assert all(10_000 < n < data_config.max_prompt_length for n in lengths), lengths


def test_built_in_exact_match_reward_scores_the_answers(prepared):
    import pandas as pd

    row = pd.read_parquet(prepared / "train.parquet").iloc[0]
    gold = row["reward_model"]["ground_truth"]
    answer = gold["target"][0]
    assert default_compute_score(row["data_source"], f"Step by step... <answer>{answer}</answer>", gold) == 1.0
    assert default_compute_score(row["data_source"], "<answer>certainly not this</answer>", gold) == 0.0
    assert default_compute_score(row["data_source"], answer, gold) == 0.0  # no tags, no credit


def test_bad_input_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"id": "x", "question": "q?"}]')
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples/prepare_musique_longctx.py"),
            "--input",
            str(bad),
            "--output",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert "record 0 of" in run.stderr and "lacks ['answer', 'paragraphs']" in run.stderr
