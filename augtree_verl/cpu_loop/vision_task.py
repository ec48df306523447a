"""A tiny vision-language model and an image task for running verl's RL loop on CPU, generated (no download).

- The model is a Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``: a 1-block vision tower, a small mrope text
  model) with random weights (seeded), with Qwen2.5's tokenizer from a local folder (``tests/data/qwen2_5_tokenizer``
  in this repository: it has the ``<|vision_start|>``, ``<|image_pad|>`` tokens), Qwen2-VL's chat template and
  Qwen2-VL's image processor (patches of 14 pixels, 2 x 2 merged into one token), behind an image-only processor
  (``vl_processor``: the CPU stack has no torchvision for transformers' video processors), so verl's
  ``hf_processor``/``hf_tokenizer`` and ``AutoProcessor`` load it offline (``trust_remote_code=True``).
- An untrained model with a 151k-word vocabulary would never say a colour, so every answer would score 0 and
  GRPO would have no gradient. The random weights carry a prior for the task's answer words instead: every token
  embedding shares one direction, which reaches the LM head through the final norm, and the answer words' (and
  end-of-turn's) LM-head rows point along it (``ANSWER_LOGIT``), so the untrained model answers in the task's
  words, which of them varying with the sample (``ANSWER_SPREAD``).
- The task: each prompt is one ``IMAGE_SIZE`` image of 1-3 filled shapes (circles, squares, triangles) on white
  and one question, "what colour is the shape?" (one shape) or "how many shapes are there?" (shapes of one
  colour); the answer is one word, checked exactly (``reward.compute_score``). Rows are verl's RL format, as
  verl's ``examples/data_preprocess/geo3k.py`` writes them: ``prompt`` (chat messages whose text holds
  ``<image>``), ``images`` (``[{"bytes": PNG}]``), ``data_source``, ``reward_model.ground_truth``, ``extra_info``.
  Deterministic from the seed.

``python -m augtree_verl.cpu_loop.vision_task --out DIR --tokenizer TOKENIZER_DIR`` writes ``DIR/model`` and
``DIR/data/{train,test}.parquet``.
"""

from __future__ import annotations

import argparse
import io
import random
from dataclasses import dataclass
from pathlib import Path

from augtree_verl.cpu_loop.reward import SHAPES_DATA_SOURCE
from augtree_verl.cpu_loop.task import require_positive, write_splits

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
COUNTS = ("one", "two", "three")
SHAPES = ("circle", "square", "triangle")
COLOUR_QUESTION = "<image>What colour is the shape? Answer with one word."
COUNT_QUESTION = "<image>How many shapes are there? Answer with one word."
# 112 x 112 pixels: 8 x 8 patches of 14, merged 2 x 2 into 4 x 4 = 16 image tokens per prompt; a shape is at least
# MIN_SHAPE pixels across, so it covers whole patches.
IMAGE_SIZE, MIN_SHAPE, MAX_SHAPE = 112, 24, 40
# The answer words' logit along the shared direction. Qwen2.5's 151,665 other tokens sit near logit 0, so their
# mass is about e^12; the 8 answer and end-of-turn tokens reach about 80% of it at 26 (the hidden state's share along
# the shared direction, after two layers, is about 0.6).
ANSWER_LOGIT = 26.0
# The spread of those logits between answer words (their rows' random part, in logits): about one, so a prompt's
# samples pick different answers.
ANSWER_SPREAD = 1.0
# The share of the shared direction in each token embedding's norm; the rest (random) tells the tokens apart.
SHARED_EMBEDDING = 0.8
# Qwen2-VL's chat template: string content or a list of text / image / video parts.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class VisionTaskConfig:
    """Sizes of the generated model and data; validated on construction."""

    train_rows: int = 64
    test_rows: int = 8
    hidden_size: int = 64
    num_layers: int = 2
    seed: int = 0

    def __post_init__(self):
        require_positive(self, ("train_rows", "test_rows", "hidden_size", "num_layers"))
        if self.hidden_size % 32:
            raise ValueError(f"hidden_size must be a multiple of 32 (4 heads, mrope over 8k), got {self.hidden_size}")


def build_processor(tokenizer_dir: str | Path):
    """The image-only Qwen2.5-VL processor over the tokenizer in ``tokenizer_dir``, with Qwen2-VL's chat template."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    from augtree_verl.cpu_loop.vl_processor import Qwen2_5_VLProcessor

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer, chat_template=CHAT_TEMPLATE
    )


def answer_token_ids(tokenizer) -> list[int]:
    """The ids of the answer words after a space (so the words the prior favours stay apart) and end-of-turn."""
    ids = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    for word in (*COLOURS, *COUNTS):
        (piece,) = tokenizer.encode(" " + word, add_special_tokens=False)
        ids.append(piece)
    return ids


def save_vision_model(directory: Path, config: VisionTaskConfig, tokenizer_dir: str | Path) -> Path:
    """The random-weight tiny Qwen2.5-VL with its processor, saved as a Hugging Face model directory."""
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    processor = build_processor(tokenizer_dir)
    tokenizer = processor.tokenizer
    heads, head_dim = 4, config.hidden_size // 4
    model_config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=config.hidden_size,
            intermediate_size=2 * config.hidden_size,
            num_hidden_layers=config.num_layers,
            num_attention_heads=heads,
            num_key_value_heads=2,
            # mrope: head_dim / 2 rotary frequencies split over temporal, height and width as Qwen2.5-VL's 16/24/24
            rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0, mrope_section=_mrope(head_dim)),
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            out_hidden_size=config.hidden_size,
            fullatt_block_indexes=[0],
        ),
        image_token_id=processor.image_token_id,
        video_token_id=processor.video_token_id,
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
    )
    torch.manual_seed(config.seed)
    model = Qwen2_5_VLForConditionalGeneration(model_config)
    _answer_prior(model, answer_token_ids(tokenizer))
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id], pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(directory)
    type(processor).register_for_auto_class("AutoProcessor")  # saves vl_processor.py beside, as remote code
    processor.save_pretrained(directory)
    return directory


def _mrope(head_dim: int) -> list[int]:
    """Qwen2.5-VL's split of the rotary frequencies (16, 24, 24 of 64) scaled to ``head_dim``."""
    half = head_dim // 2
    temporal = half // 4
    return [temporal, (half - temporal) // 2, half - temporal - (half - temporal) // 2]


def _answer_prior(model, answer_ids: list[int]) -> None:
    """Point every token embedding partly along one direction u and the answer rows of the LM head along u
    (see the module docstring); the final norm makes the hidden state's norm sqrt(hidden), so the answer logits
    sit near ``ANSWER_LOGIT``."""
    import torch

    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    hidden = embed.shape[1]
    u = torch.nn.functional.normalize(torch.randn(hidden), dim=0)
    with torch.no_grad():
        scale = embed.norm(dim=1, keepdim=True).mean()
        embed.mul_((1 - SHARED_EMBEDDING**2) ** 0.5).add_(SHARED_EMBEDDING * scale * u)
        spread = torch.randn(len(answer_ids), hidden) * ANSWER_SPREAD / hidden**0.5
        head[answer_ids] = (ANSWER_LOGIT / hidden**0.5) * u + spread


def draw(shapes: list[tuple[str, str]], rng: random.Random):
    """A white ``IMAGE_SIZE`` RGB image with each (shape, colour) filled at a random place and size."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), "white")
    pen = ImageDraw.Draw(image)
    for shape, colour in shapes:
        size = rng.randint(MIN_SHAPE, MAX_SHAPE)
        x, y = rng.randint(0, IMAGE_SIZE - size), rng.randint(0, IMAGE_SIZE - size)
        box, fill = (x, y, x + size, y + size), COLOURS[colour]
        if shape == "circle":
            pen.ellipse(box, fill=fill)
        elif shape == "square":
            pen.rectangle(box, fill=fill)
        else:
            pen.polygon([(x + size // 2, y), (x, y + size), (x + size, y + size)], fill=fill)
    return image


def task_rows(num_rows: int, *, split: str, seed: int) -> list[dict]:
    """``num_rows`` verl RL rows of the shape task (see the module docstring): colour and count questions in turn."""
    rng = random.Random(seed)
    rows = []
    for index in range(num_rows):
        colour = rng.choice(list(COLOURS))
        count = 1 if index % 2 == 0 else rng.randint(1, len(COUNTS))
        shapes = [(rng.choice(SHAPES), colour) for _ in range(count)]
        question, answer = (COLOUR_QUESTION, colour) if index % 2 == 0 else (COUNT_QUESTION, COUNTS[count - 1])
        png = io.BytesIO()
        draw(shapes, rng).save(png, format="PNG")
        rows.append(
            {
                "data_source": SHAPES_DATA_SOURCE,
                "prompt": [{"role": "user", "content": question}],
                "images": [{"bytes": png.getvalue()}],
                "ability": "vision",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": split, "index": index, "shapes": count},
            }
        )
    return rows


def write_vision_task(out: Path, tokenizer_dir: str | Path, config: VisionTaskConfig = VisionTaskConfig()):
    """Write ``out/model`` and ``out/data/{train,test}.parquet``; returns (model dir, data dir)."""
    out = Path(out)
    model_dir = save_vision_model(out / "model", config, tokenizer_dir)
    splits = {
        "train": task_rows(config.train_rows, split="train", seed=config.seed),
        "test": task_rows(config.test_rows, split="test", seed=config.seed + 1),
    }
    return model_dir, write_splits(out / "data", splits)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="output directory (model/ and data/)")
    parser.add_argument("--tokenizer", required=True, type=Path, help="a Qwen2.5 tokenizer folder")
    defaults = VisionTaskConfig()
    names = ("train_rows", "test_rows", "seed")
    for name in names:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    args = parser.parse_args(argv)
    config = VisionTaskConfig(**{name: getattr(args, name) for name in names})
    model_dir, data_dir = write_vision_task(args.out, args.tokenizer, config)
    print(f"model: {model_dir}\ndata: {data_dir}")


if __name__ == "__main__":
    main()
