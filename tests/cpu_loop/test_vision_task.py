"""The generated vision task: verl loads the tiny vision-language model's processor offline, its dataset reads the
images (without torchvision), the reward checks the answer exactly, and the data is the seed's."""

from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf
from transformers import AutoProcessor
from verl.utils import hf_processor, hf_tokenizer

from augtree_verl.cpu_loop.image_dataset import ImageRLHFDataset
from augtree_verl.cpu_loop.reward import SHAPES_DATA_SOURCE, compute_score
from augtree_verl.cpu_loop.vision_task import IMAGE_SIZE, VisionTaskConfig, main, task_rows

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "tests" / "data" / "qwen2_5_tokenizer"
# 112 x 112 pixels in patches of 14, merged 2 x 2: 16 image tokens
IMAGE_TOKENS = (IMAGE_SIZE // 14 // 2) ** 2


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    out = tmp_path_factory.mktemp("vision")
    main(["--out", str(out), "--tokenizer", str(TOKENIZER), "--train-rows", "4", "--test-rows", "2"])
    return out


def test_verl_loads_the_processor_offline_with_qwen2_5_vls_rope_index(task, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    processor = hf_processor(str(task / "model"), trust_remote_code=True)
    assert type(processor).__name__ == "Qwen2_5_VLProcessor" and hasattr(processor, "get_rope_index")
    assert type(AutoProcessor.from_pretrained(task / "model", trust_remote_code=True)).__name__ == "Qwen2_5_VLProcessor"
    tokenizer = hf_tokenizer(str(task / "model"))
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == processor.image_token_id


def test_verls_dataset_reads_the_images_and_the_chat_template_places_them(task):
    processor = hf_processor(str(task / "model"), trust_remote_code=True)
    config = OmegaConf.create({"max_prompt_length": 256, "image_key": "images", "filter_overlong_prompts": True})
    dataset = ImageRLHFDataset(str(task / "data/train.parquet"), processor.tokenizer, config, processor=processor)
    assert len(dataset) == 4
    messages = dataset[0]["raw_prompt"]
    images, videos, _ = ImageRLHFDataset._process_multi_modal_info(messages, image_patch_size=14, config=config)
    assert videos is None and [image.size for image in images] == [(IMAGE_SIZE, IMAGE_SIZE)]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = list(processor(text=[text], images=images)["input_ids"][0])
    assert ids.count(processor.image_token_id) == IMAGE_TOKENS
    assert text.endswith("Answer with one word.<|im_end|>\n<|im_start|>assistant\n")


def test_the_rows_are_verls_format_and_the_seeds():
    rows = task_rows(6, split="train", seed=3)
    assert rows == task_rows(6, split="train", seed=3) and rows != task_rows(6, split="train", seed=4)
    assert {row["data_source"] for row in rows} == {SHAPES_DATA_SOURCE}
    assert all(row["prompt"][0]["content"].startswith("<image>") and len(row["images"]) == 1 for row in rows)
    answers = [row["reward_model"]["ground_truth"] for row in rows]
    assert answers[0] in ("red", "green", "blue", "yellow") and answers[1] in ("one", "two", "three")


def test_the_answer_is_checked_exactly(task):
    row = pd.read_parquet(task / "data/train.parquet").iloc[0]
    answer = row["reward_model"]["ground_truth"]
    assert compute_score(SHAPES_DATA_SOURCE, f" {answer.upper()}. and more", answer) == 1.0
    assert compute_score(SHAPES_DATA_SOURCE, f"{answer}ish", answer) == 0.0
    assert compute_score(SHAPES_DATA_SOURCE, f"no {answer}", answer) == 0.0
    assert compute_score(SHAPES_DATA_SOURCE, "", answer) == 0.0


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="hidden_size must be a multiple of 32"):
        VisionTaskConfig(hidden_size=48)
