"""verl's ``RLHFDataset`` with its images read without torchvision, for the vision loop on CPU.

verl reads a row's images with ``qwen_vl_utils.process_vision_info``, and ``qwen_vl_utils`` imports torchvision,
which the CPU stack has no build of (PyPI's torchvision links CUDA torch). This dataset reads them with PIL alone,
as ``qwen_vl_utils.fetch_image`` does: RGB, resized to sides that are multiples of a merged patch
(``image_patch_size`` x ``SPATIAL_MERGE_SIZE``) within ``MIN_TOKENS`` to ``MAX_TOKENS`` merged patches (images
whose sides already are, as the generated shape task's, keep their pixels). verl's agent loop calls it for the
rollout and computes the trainer's ``multi_modal_inputs`` from the same images, so the two agree. Videos and
audio are refused. Select it with ``data.custom_cls.path=pkg://augtree_verl.cpu_loop.image_dataset``,
``data.custom_cls.name=ImageRLHFDataset``.
"""

from __future__ import annotations

import io

from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from verl.utils.dataset.rl_dataset import RLHFDataset

# qwen_vl_utils' defaults: patches merge 2 x 2 into one token; an image takes 4 to 16384 such tokens.
SPATIAL_MERGE_SIZE = 2
MIN_TOKENS, MAX_TOKENS = 4, 16384


def load_image(item: dict, image_patch_size: int) -> Image.Image:
    """A message part's image (``image``: PIL or a path, or ``bytes``), RGB and resized as the module says."""
    image = item.get("image")
    if image is None:
        image = Image.open(io.BytesIO(item["bytes"]))
    elif not isinstance(image, Image.Image):
        image = Image.open(image)
    image = image.convert("RGB")
    factor = image_patch_size * SPATIAL_MERGE_SIZE
    height, width = smart_resize(
        image.height, image.width, factor=factor, min_pixels=MIN_TOKENS * factor**2, max_pixels=MAX_TOKENS * factor**2
    )
    return image if (width, height) == image.size else image.resize((width, height), Image.Resampling.BICUBIC)


class ImageRLHFDataset(RLHFDataset):
    """``RLHFDataset`` whose image reading needs no torchvision (see the module docstring)."""

    @classmethod
    def _process_multi_modal_info(cls, messages: list[dict], image_patch_size, config):
        """(images or None, videos None, audios None) of ``messages``, as verl's own returns them."""
        parts = [part for m in messages if isinstance(m.get("content"), list) for part in m["content"]]
        kinds = {part.get("type") for part in parts if isinstance(part, dict)}
        if kinds & {"video", "audio"}:
            raise ValueError(f"the CPU image dataset reads images only; a row has {sorted(kinds & {'video', 'audio'})}")
        images = [load_image(p, image_patch_size) for p in parts if isinstance(p, dict) and p.get("type") == "image"]
        return images or None, None, None
