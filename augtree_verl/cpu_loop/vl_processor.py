"""Qwen2.5-VL's processor for images only: the generated tiny vision-language model's (``cpu_loop.vision_task``).

transformers' Qwen-VL processors hold a video processor, and transformers' video processors need torchvision,
which the CPU stack has no build of (PyPI's torchvision links CUDA torch); without it ``AutoProcessor`` fails, and
verl's ``hf_processor`` gives None, so verl's dataset and agent loop could not read images. This is transformers'
own ``Qwen2_5_VLProcessor`` without the video processor: the same class name, so verl's ``hf_processor`` binds
Qwen2.5-VL's ``get_rope_index`` to it, and the same text and image handling; videos are not processed.
``vision_task.save_vision_model`` saves it into the model directory as transformers' remote code (this file is
copied there): load the model with ``trust_remote_code=True``. It imports nothing but transformers, since it runs
from that copy.
"""

from __future__ import annotations

import transformers
from transformers.processing_utils import ProcessorMixin


class Qwen2_5_VLProcessor(transformers.Qwen2_5_VLProcessor):
    """An image processor and a tokenizer; the image and video placeholder tokens as Qwen2.5-VL's processor
    sets them."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
