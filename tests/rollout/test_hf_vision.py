"""The ``hf`` rollout's server on a vision-language model: a request's images (verl's ``image_data``) go through
the model's processor into its forward, and the tokens and log-probs are those of the model's own computation."""

from __future__ import annotations

import asyncio

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from verl.workers.config import RolloutConfig

from augtree_verl.cpu_loop.vision_task import IMAGE_SIZE, VisionTaskConfig, save_vision_model
from augtree_verl.rollout.hf_server import HFRolloutServer
from tests.cpu_loop.test_vision_task import TOKENIZER

RESPONSE_LENGTH = 6
TINY = VisionTaskConfig(hidden_size=32, num_layers=1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = save_vision_model(tmp_path_factory.mktemp("vl") / "model", TINY, TOKENIZER)
    config = RolloutConfig(name="hf", prompt_length=64, response_length=RESPONSE_LENGTH, tensor_model_parallel_size=1)
    return HFRolloutServer(config, OmegaConf.create({"path": str(model_dir), "trust_remote_code": True}), 0)


def _image(colour: str) -> Image.Image:
    return Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), colour)


def _prompt(server) -> list[int]:
    """A chat prompt with one image, its placeholder expanded by the processor (as verl's agent loop sends it)."""
    processor = server.model_config.processor
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return [int(t) for t in processor(text=[text], images=[_image("red")])["input_ids"][0]]


def _generate(server, prompt, image, request_id="r", **params):
    params = {"temperature": 1.0, "logprobs": True, **params}
    return asyncio.run(
        server.generate(prompt_ids=prompt, sampling_params=params, request_id=request_id, image_data=[image])
    )


def _model_logprobs(server, prompt, image, response) -> list[float]:
    """The response's log-probs from one forward of the whole sequence, positions computed by transformers."""
    processor = server.model_config.processor
    ids = torch.tensor([prompt + response])
    features = processor.image_processor(images=[image], return_tensors="pt")
    with torch.no_grad():
        logits = server.model(
            input_ids=ids,
            pixel_values=features["pixel_values"],
            image_grid_thw=features["image_grid_thw"],
            mm_token_type_ids=(ids == processor.image_token_id).int(),
        ).logits[0]
    logps = torch.log_softmax(logits.float(), dim=-1)
    return [float(logps[len(prompt) - 1 + i, token]) for i, token in enumerate(response)]


def test_greedy_decoding_is_the_models_own_generate(server):
    prompt, image = _prompt(server), _image("red")
    out = _generate(server, prompt, image, temperature=0, max_tokens=RESPONSE_LENGTH)
    processor = server.model_config.processor
    features = processor.image_processor(images=[image], return_tensors="pt")
    ids = torch.tensor([prompt])
    want = server.model.generate(
        input_ids=ids,
        pixel_values=features["pixel_values"],
        image_grid_thw=features["image_grid_thw"],
        mm_token_type_ids=(ids == processor.image_token_id).int(),
        max_new_tokens=len(out.token_ids),
        do_sample=False,
        eos_token_id=None,
    )[0, len(prompt) :].tolist()
    assert out.token_ids == want


def test_sampled_tokens_carry_the_models_log_probs(server):
    """Each decoded token sits at its multimodal position (after the image's rope offset)."""
    prompt, image = _prompt(server), _image("blue")
    out = _generate(server, prompt, image, max_tokens=RESPONSE_LENGTH)
    want = _model_logprobs(server, prompt, image, out.token_ids)
    assert out.log_probs == pytest.approx(want, abs=1e-5)


def test_prompts_with_the_same_ids_and_other_images_are_told_apart(server):
    """Same text and image size, so the same ids: the images' digest keys the prefill and the request seeds."""
    prompt = _prompt(server)
    misses = server.prefixes.counts["misses"]
    red = _generate(server, prompt, _image("red"), request_id="a", temperature=0)
    green = _generate(server, prompt, _image("green"), request_id="b", temperature=0)
    assert server.prefixes.counts["misses"] == misses + 2
    assert red.log_probs != green.log_probs  # each decoded from its own image's prefill


def test_videos_are_refused_naming_the_request(server):
    with pytest.raises(ValueError, match="request clip-7 has video"):
        asyncio.run(server.generate(prompt_ids=[1, 2], sampling_params={}, request_id="clip-7", video_data=[object()]))
