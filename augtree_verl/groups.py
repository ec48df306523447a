"""The replay tree (one prompt and the responses sampled from it), its identity and its estimated work.

One tree type for the trainer, the plan field, the engine and the replay. A tree is identified by
``tree_id(uid, prompt_len)`` = ``"<uid>|<prompt_len>"``: the trainer, which knows only lengths, plans under
it, and the engine finds the trainer's plan under it. The trainer's trees carry lengths only; the engine's
and the replay's also carry the token ids (``Tree.of_tokens``). Samples that share a uid but not a prompt
length (e.g. multi-turn outputs) are separate trees of one group. ``GroupLengths`` is a tree's lengths alone,
checked once: what the rollout reports, the planner plans and the trainer asks plans for (``Tree.lengths``).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# A row's position ids on a model with M-RoPE (verl's agent loop, transformers' Qwen2-VL family): its text
# positions, then the temporal, height and width axes.
MROPE_AXES = 4


@dataclass(frozen=True, eq=False)
class Vision:
    """A prompt's images as verl's batch carries them for an M-RoPE vision-language model (one row's
    ``multi_modal_inputs`` and position ids).

    ``pixels`` [N, D]: ``pixel_values``, N patches of D = channels x temporal patch x patch^2 values, every image's
    in order; ``grid_thw`` LongTensor [n, 3]: ``image_grid_thw``, each image's (t, h, w) patch grid;
    ``positions`` LongTensor [MROPE_AXES, P]: the prompt's position ids from verl's batch (text positions, then the
    temporal, height and width axes of ``get_rope_index``). After the prompt every axis advances by one a token:
    token k >= P has text position k and M-RoPE positions k + ``shift`` on the three others.
    """

    pixels: torch.Tensor
    grid_thw: torch.Tensor
    positions: torch.Tensor

    @property
    def shift(self) -> int:
        """M-RoPE position of the first token after the prompt, less the prompt's length."""
        return int(self.positions[1:].max()) + 1 - self.positions.shape[1]

    def key(self) -> bytes:
        """Equal for equal images and positions, bit for bit (what a tree's rows must share)."""
        parts = (self.pixels, self.grid_thw, self.positions)
        return b"|".join(repr((x.dtype, tuple(x.shape))).encode() + x.cpu().numpy().tobytes() for x in parts)


def positive_int(value, what: str) -> int:
    """``value`` as an int if it is a positive integer (not a bool); ``ValueError`` naming ``what`` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be a positive int, got {value!r}") from None
    if value < 1:
        raise ValueError(f"{what} must be a positive int, got {value}")
    return value


@dataclass(frozen=True)
class GroupLengths:
    """The lengths of one tree (a group's prompt and its responses), the one form they take from the rollout
    through the planner to the batch.

    ``prompt_len``: P, the prompt's tokens; ``response_lens`` (G,): R_i, response i's tokens, in the order
    the planner sees them (the rollout's (session, index) order; the batch's order of first appearance).
    Checked once, here: P and every R_i positive ints (numpy ints too; not bools), G >= 1; ``ValueError``
    names the bad value. Stored as ``int`` and a tuple of ``int``, so two records are equal when their lengths
    are; frozen, hashable and pickled as is across Ray.
    """

    prompt_len: int
    response_lens: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "prompt_len", positive_int(self.prompt_len, "prompt_len"))
        try:
            lens = tuple(self.response_lens)
        except TypeError:
            raise ValueError(f"response_lens must be a sequence of positive ints, got {self.response_lens!r}") from None
        if not lens:
            raise ValueError("response_lens is empty: a tree needs at least one response")
        object.__setattr__(
            self, "response_lens", tuple(positive_int(r, f"response_lens[{i}]") for i, r in enumerate(lens))
        )


def tree_id(uid: str, prompt_len: int) -> str:
    """The identity of the tree of group ``uid`` whose prompt has ``prompt_len`` tokens."""
    return f"{uid}|{prompt_len}"


@dataclass(frozen=True, eq=False)
class Tree:
    """One replay tree: a prompt and the samples that respond to it.

    ``samples[i]``: the batch index of response i (empty outside a batch); ``response_lens[i]`` its length;
    the order is the order of first appearance in the batch (the order the planner sees). With tokens
    (``of_tokens``): ``prompt`` LongTensor [P] and ``responses`` G LongTensors [R_i], on the model's device.
    ``call_lens[i]``: the length of the model call verl's stock engine runs response i's row in (the longest
    row of its verl micro-batch, whose rows it packs into one call); empty: each row alone (P + R_i, as the
    flattened baseline runs it). ``rope_len``: the call length this tree's model calls fix a length-dependent
    rope's frequencies for (``replay.rope``; set by ``rope.split_regimes``); None: each call's own. ``vision``: the
    prompt's images and M-RoPE positions (``Vision``; ``replay.vlm``); None: a text prompt.
    """

    uid: str
    prompt_len: int
    response_lens: tuple[int, ...]
    samples: tuple[int, ...] = ()
    prompt: torch.Tensor | None = None
    responses: tuple[torch.Tensor, ...] = ()
    call_lens: tuple[int, ...] = ()
    rope_len: int | None = None
    vision: Vision | None = None

    @classmethod
    def of_tokens(
        cls,
        prompt: torch.Tensor,
        responses: Sequence[torch.Tensor],
        *,
        uid: str = "",
        samples: Sequence[int] = (),
        call_lens: Sequence[int] = (),
        vision: Vision | None = None,
    ) -> Tree:
        """The tree of ``prompt`` [P] and ``responses`` [R_i] (checked by ``check_tokens``, not here)."""
        return cls(
            uid=uid,
            prompt_len=len(prompt),
            response_lens=tuple(len(r) for r in responses),
            samples=tuple(samples),
            prompt=prompt,
            responses=tuple(responses),
            call_lens=tuple(int(n) for n in call_lens),
            vision=vision,
        )

    @property
    def tree_id(self) -> str:
        return tree_id(self.uid, self.prompt_len)

    @property
    def lengths(self) -> GroupLengths:
        """This tree's lengths (what the planner plans); ``ValueError`` naming the tree and the bad value."""
        try:
            return GroupLengths(self.prompt_len, self.response_lens)
        except ValueError as err:
            raise ValueError(f"tree {self.tree_id!r} (group {self.uid!r}): {err}") from None

    @property
    def row_call_lens(self) -> tuple[int, ...]:
        """Per response, the length of the stock engine's call that holds its row (``call_lens``; default P + R_i)."""
        return self.call_lens or tuple(self.prompt_len + r for r in self.response_lens)

    def part(self, rows: Sequence[int], *, rope_len: int | None) -> Tree:
        """The tree of responses ``rows`` (indices, in order) of this one, its model calls at ``rope_len``."""
        pick = lambda values: tuple(values[i] for i in rows) if values else ()
        return dataclasses.replace(
            self,
            response_lens=pick(self.response_lens),
            samples=pick(self.samples),
            responses=pick(self.responses),
            call_lens=pick(self.call_lens),
            rope_len=rope_len,
        )

    def check_tokens(self, index: int, vocab_size: int | None = None, device: torch.device | None = None) -> None:
        """Raise ``ValueError`` naming tree ``index`` (and the response) for malformed token ids: not 1-D
        integer tensors, empty, no responses; with ``vocab_size`` and ``device``, ids outside the vocabulary
        or on another device. The vocabulary range of all the tree's ids is read in one device-to-host copy
        (one host sync per tree, before any kernel runs), not one per sequence."""
        _check_ids(self.prompt, f"tree {index} prompt", device)
        if len(self.responses) == 0:
            raise ValueError(f"tree {index} has no responses")
        for i, r in enumerate(self.responses):
            _check_ids(r, f"tree {index} response {i}", device)
        if self.call_lens and (
            len(self.call_lens) != len(self.responses)
            or any(n < self.prompt_len + r for n, r in zip(self.call_lens, self.response_lens))
        ):
            raise ValueError(
                f"tree {index}: call_lens {list(self.call_lens)} must give each of its {len(self.responses)} responses "
                f"a call at least as long as its row (prompt {self.prompt_len} + response lengths "
                f"{list(self.response_lens)})"
            )
        if vocab_size is None:
            return
        ids = [self.prompt, *self.responses]
        bounds = torch.stack([torch.stack([t.min(), t.max()]) for t in ids]).tolist()
        for j, (lo, hi) in enumerate(bounds):
            if lo < 0 or hi >= vocab_size:
                what = f"tree {index} prompt" if j == 0 else f"tree {index} response {j - 1}"
                raise ValueError(f"{what} has token id {lo if lo < 0 else hi} outside the vocabulary [0, {vocab_size})")


def _check_ids(t, what: str, device: torch.device | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor of token ids, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{what} is empty")
    if t.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{what} must hold integer token ids, got dtype {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{what} is on {t.device} but the model is on {device}")


# verl's per-sequence work estimate w(s) = 12 h^2 s + 2 h s^2 at h = 4096, divided by 2h
# (``verl.utils.seqlen_balancing.calculate_workload``, which the stock trainer balances by): linear layers plus causal
# attention. Written here so the ground floor imports no verl; tests/test_groups.py holds it equal to verl's.
WORKLOAD_LINEAR = 24576


def sequence_workload(lens: torch.Tensor) -> torch.Tensor:
    """w(s) per sequence length (int64 tensor), verl's estimate (``WORKLOAD_LINEAR``)."""
    return WORKLOAD_LINEAR * lens + lens**2


def tree_workload(prompt_len: int, response_lens: Sequence[int]) -> int:
    """Estimated work of replaying one tree with the prompt run once.

    With verl's per-sequence estimate w(s) (``sequence_workload``: linear layers + causal attention), a flattened
    group costs sum_i w(P + R_i). Running the prompt once removes G - 1 prompt passes and keeps each response's
    attention to the prompt (the 2·P·R_i cross term of w(P + R_i)), so the tree costs
    sum_i w(P + R_i) - (G - 1)·w(P).
    """
    lens = torch.tensor([prompt_len] + [prompt_len + r for r in response_lens], dtype=torch.int64)
    work = sequence_workload(lens)
    return int(work[1:].sum() - (len(response_lens) - 1) * work[0])


def find_trees(
    uids: Sequence,
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    sequences: Sequence[torch.Tensor] | None = None,
    call_lens: Sequence[int] = (),
    visions: Sequence[Vision | None] = (),
) -> list[Tree]:
    """Group samples into trees by ``tree_id``; raise ValueError naming the sample on bad input.

    With ``sequences`` (sample i's token ids [prompt_lens[i] + response_lens[i]]) the trees carry their
    tokens, and samples of one ``tree_id`` whose prompt tokens differ become separate trees (each is
    then only part of the tree the trainer planned, so a split plan cannot apply to it); ``call_lens[i]``:
    the length of the stock engine's call holding sample i (``Tree.call_lens``; empty: each row alone);
    ``visions[i]``: sample i's images (``Vision``, None for a text prompt; empty: none has any), of which the
    samples of one tree share equal ones (``Vision.key``): samples whose images differ become separate trees too.
    """
    if not len(uids) == len(prompt_lens) == len(response_lens):
        raise ValueError(
            f"uids, prompt_lens and response_lens must have one entry per sample, got "
            f"{len(uids)}, {len(prompt_lens)} and {len(response_lens)}"
        )
    members: dict[tuple, list[int]] = {}
    if sequences is not None:  # every sample's prompt tokens in one device-to-host copy (one sync per step)
        prompts = torch.cat([sequences[i][: int(p)] for i, p in enumerate(prompt_lens)]).cpu().numpy()
        offsets = np.cumsum([0] + [int(p) for p in prompt_lens])
    for i, (uid, p, r) in enumerate(zip(uids, prompt_lens, response_lens)):
        if not isinstance(uid, str) or not uid:
            raise ValueError(f"sample {i} has uid {uid!r}; every sample needs a non-empty string uid")
        if int(p) < 1 or int(r) < 1:
            raise ValueError(f"sample {i} of group {uid!r} has prompt_len={p}, response_len={r}; both must be >= 1")
        key: tuple = (uid, int(p))
        if sequences is not None:
            key += (prompts[offsets[i] : offsets[i + 1]].tobytes(),)
            key += (visions[i].key() if visions and visions[i] is not None else None,)
        members.setdefault(key, []).append(i)
    if sequences is None:
        return [
            Tree(uid=uid, prompt_len=p, samples=tuple(idx), response_lens=tuple(int(response_lens[i]) for i in idx))
            for (uid, p), idx in members.items()
        ]
    return [
        Tree.of_tokens(
            sequences[idx[0]][:p],
            [sequences[i][p:] for i in idx],
            uid=uid,
            samples=idx,
            call_lens=[call_lens[i] for i in idx] if call_lens else (),
            vision=visions[idx[0]] if visions else None,
        )
        for (uid, p, _, _), idx in members.items()
    ]
