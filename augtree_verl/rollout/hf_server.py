"""The CPU rollout server: a Ray actor that generates with the Hugging Face model (token in, token out).

It answers what verl's agent loop and trainer call on a rollout server (vLLM's ``vLLMHttpServer``
contract in verl 0.9.1): ``generate(prompt_ids, sampling_params, request_id, ...) -> TokenOutput`` with
``extra_fields["global_steps"]``, the version of the weights that produced it, and the memory calls
(``wake_up``, ``sleep``, KV-cache release/resume, abort/resume, profiling) as no-ops: the model stays in
host memory and requests run one at a time. Weights arrive with ``load_weights`` from the trainer side
(``hf.HFServerAdapter``). The model is loaded with the auto class verl's trainer uses for it, so a
vision-language checkpoint is its ``*ForConditionalGeneration`` (the trainer's weight names); its requests may
carry images (``image_data``), which the model's processor turns into its inputs (``multimodal``); videos and
audio are refused, naming the request.

Sampling is reproducible: each request's generator is seeded from the rollout seed, the weights' version,
the prompt (its ids and its images' digest) and how many requests for that prompt this server has seen at that
version. So a group's G
responses are the same set on every run with the same seed and weights (their order within the group may
differ); ``rollout.temperature=0`` decodes greedily.

A group's prompt is prefilled once, as vLLM's prefix caching does: verl's agent loop sends a group's n
requests one by one, each with the full prompt ids, so the server keeps each prompt's prefill
(``PrefixCache``, keyed by the prompt ids and images) and decodes every response from a copy of it; the tokens are
those of a prefill per request. An entry leaves when its group's n requests are served, when it is the
least recently used beyond ``PREFIX_CACHE_ENTRIES``, or when new weights arrive; all counted
(``prefix_cache_stats``).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter, OrderedDict

import torch
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.model import get_hf_auto_model_class
from verl.workers.config import HFModelConfig
from verl.workers.rollout.replica import TokenOutput

from augtree_verl.rollout.multimodal import PromptInputs, prompt_inputs
from augtree_verl.rollout.sampling import Prefix, SamplingConfig, decode, prefill

# Prompts whose prefill the server keeps at once. verl's agent loop issues every prompt of a batch
# concurrently and the server serves requests one at a time in arrival order, so the groups open at
# once are the prompts in flight; beyond the bound the least recently used prompt is prefilled again
# when its next request comes (counted as a miss), which costs time, never exactness.
PREFIX_CACHE_ENTRIES = 32


def _stop_ids(model_config: HFModelConfig) -> set[int]:
    """EOS ids of the generation config and the tokenizer (vLLM stops on both)."""
    ids: set[int] = set()
    for source in (model_config.generation_config, model_config.tokenizer):
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return ids


def request_seed(seed: int, global_steps: int, prompt_ids: list[int], index: int, media: str = "") -> int:
    """A 63-bit seed for the ``index``-th request for ``prompt_ids`` (with images of digest ``media``, "" for
    none) at weight version ``global_steps``."""
    key = f"{seed}/{global_steps}/{index}/" + ",".join(map(str, prompt_ids)) + (f"/{media}" if media else "")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


class PrefixCache:
    """Prefilled prompts of the loaded weights, keyed by the prompt ids and images, least recently used first.

    ``get`` returns a prompt's ``Prefix`` (prefilling it on a miss); after ``group_size`` uses (a group's n
    requests) the entry leaves. ``max_entries`` >= 1 bounds the entries; ``clear`` drops them all (new
    weights). Counters: hits, misses, completed (left after their group), evicted (left by the bound).
    """

    def __init__(self, max_entries: int, group_size: int):
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        if group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {group_size}")
        self.max_entries, self.group_size = max_entries, group_size
        self._entries: OrderedDict[tuple[tuple[int, ...], str], tuple[Prefix, int]] = OrderedDict()
        self.counts: Counter = Counter()

    def get(self, model, prompt_ids: list[int], inputs: PromptInputs | None = None) -> Prefix:
        """The prefill of ``prompt_ids`` (a non-empty list of ids, with their ``inputs``) under ``model``, from the
        cache when present."""
        key = (tuple(prompt_ids), inputs.digest if inputs is not None else "")
        entry = self._entries.pop(key, None)
        if entry is None:
            self.counts["misses"] += 1
            entry = (prefill(model, prompt_ids, inputs), 0)
        else:
            self.counts["hits"] += 1
        prefix, uses = entry[0], entry[1] + 1
        if uses == self.group_size:
            self.counts["completed"] += 1
            return prefix
        self._entries[key] = (prefix, uses)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
            self.counts["evicted"] += 1
        return prefix

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class HFRolloutServer:
    """One rollout replica's server (see the module docstring). ``config``: verl's ``RolloutConfig``."""

    def __init__(self, config, model_config, replica_rank: int):
        self.config = omega_conf_to_dataclass(config)
        self.model_config: HFModelConfig = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.replica_rank = replica_rank
        model_class = get_hf_auto_model_class(self.model_config.hf_config)  # the trainer's: its weight names
        self.model = model_class.from_pretrained(
            self.model_config.local_path,
            dtype=torch.float32,
            attn_implementation="sdpa",
            trust_remote_code=self.model_config.trust_remote_code,
        ).eval()
        self.stop_ids = _stop_ids(self.model_config)
        self.max_model_len = self.config.max_model_len or self.config.prompt_length + self.config.response_length
        # The version of the loaded weights; the trainer sets it with every weight sync.
        self.global_steps = 0
        self._requests_per_prompt: Counter = Counter()
        self.prefixes = PrefixCache(PREFIX_CACHE_ENTRIES, group_size=self.config.n)
        self._lock = asyncio.Lock()

    def _sampling_config(self, prompt_len: int, sampling_params: dict) -> SamplingConfig:
        """vLLM's bounds (``vllm_async_server.generate``): at least one token, within the context length."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(
                f"prompt length ({prompt_len}) leaves no room to generate within the model's "
                f"maximum context length ({self.max_model_len})"
            )
        params = dict(sampling_params)
        if float(params.get("repetition_penalty", 1.0)) != 1.0:
            raise ValueError(f"the hf rollout does not apply repetition_penalty={params['repetition_penalty']}")
        max_tokens = params.pop("max_tokens", params.pop("max_new_tokens", None))
        if max_tokens is None:
            max_tokens = min(
                self.config.response_length, self.config.prompt_length + self.config.response_length - prompt_len
            )
        return SamplingConfig(
            max_tokens=max(1, min(max_tokens, room)),
            temperature=float(params.get("temperature", 1.0)),
            top_k=int(params.get("top_k", -1)),
            top_p=float(params.get("top_p", 1.0)),
        )

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict,
        request_id: str,
        image_data=None,
        video_data=None,
        audio_data=None,
        mm_processor_kwargs=None,
        **kwargs,
    ) -> TokenOutput:
        prompt_ids = [int(t) for t in prompt_ids]
        config = self._sampling_config(len(prompt_ids), sampling_params)
        inputs = await asyncio.to_thread(
            prompt_inputs,
            self.model_config.processor,
            prompt_ids,
            request_id,
            image_data=image_data,
            video_data=video_data,
            audio_data=audio_data,
            **(mm_processor_kwargs or {}),
        )
        media = inputs.digest if inputs is not None else ""
        global_steps = self.global_steps
        key = (global_steps, tuple(prompt_ids), media)
        index = self._requests_per_prompt[key]
        self._requests_per_prompt[key] += 1
        seed = request_seed(self.config.seed, global_steps, prompt_ids, index, media)
        generator = torch.Generator().manual_seed(seed)
        async with self._lock:
            tokens, logps = await asyncio.to_thread(self._sample, prompt_ids, inputs, config, generator)
        return TokenOutput(
            token_ids=tokens,
            log_probs=logps if sampling_params.get("logprobs") else None,
            stop_reason="completed",
            extra_fields={"global_steps": global_steps},
        )

    def _sample(
        self, prompt_ids: list[int], inputs: PromptInputs | None, config: SamplingConfig, generator: torch.Generator
    ) -> tuple[list[int], list[float]]:
        """One response from the prompt's shared prefill (see ``PrefixCache``); runs under the server's lock."""
        prefix = self.prefixes.get(self.model, prompt_ids, inputs)
        return decode(self.model, prefix, config, stop_ids=self.stop_ids, generator=generator)

    async def prefix_cache_stats(self) -> dict[str, int]:
        """The prefix cache's counters, its entries and the per-prompt request counters of this weight version."""
        return {
            **self.prefixes.counts,
            "entries": len(self.prefixes),
            "prompts_counted": len(self._requests_per_prompt),
        }

    async def load_weights(self, state_dict: dict[str, torch.Tensor], global_steps: int | None = None) -> None:
        """Load the trainer's full (Hugging Face-named) weights; every parameter must be present."""
        async with self._lock:
            missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
            missing = [m for m in missing if m not in self._tied_keys()]
            if missing or unexpected:
                raise ValueError(
                    f"hf rollout replica {self.replica_rank}: weights missing {missing[:5]}, "
                    f"unexpected {unexpected[:5]}"
                )
            if global_steps is not None:
                self.global_steps = int(global_steps)
            self._requests_per_prompt.clear()
            self.prefixes.clear()

    def _tied_keys(self) -> set[str]:
        """Parameters a tied checkpoint need not send (the output embedding shares the input one)."""
        if not getattr(self.model.config, "tie_word_embeddings", False):
            return set()
        tied = getattr(self.model, "_tied_weights_keys", None) or []
        return set(tied.keys() if isinstance(tied, dict) else tied)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = int(global_steps)

    # The memory and scheduling calls of the server contract: nothing to do in host memory, one request at a time.
    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def abort_all_requests(self, reject_request: bool = False, **kwargs) -> dict:
        return {"aborted_count": 0, "request_ids": []}

    async def abort_request(self, request_id: str, **kwargs) -> dict:
        return {"aborted": False, "request_id": request_id}

    async def resume_generation(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        async with self._lock:
            return None

    async def start_profile(self, **kwargs) -> None:
        return None

    async def stop_profile(self) -> None:
        return None
