"""The recurrent cache: fixed-size state, allocated once, updated in place.

Each layer speaks transformers' linear-attention cache vocabulary (``conv_states``,
``recurrent_states`` and three flag dicts, keyed by state index; a GDN layer has state 0 only).
Storage is materialized at construction, never reallocated: every update is a ``copy_`` into it,
so CUDA graphs captured over a cache stay valid for its whole life. Snapshots are caches too,
so snapshot / restore / bridge are all one operation, ``copy_cache_``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

STATE_TABLES = ("conv_states", "recurrent_states")
FLAG_TABLES = ("has_previous_state", "is_conv_states_initialized",
               "is_recurrent_states_initialized")


@dataclass(frozen=True)
class LayerStateSpec:
    """Shapes of one GDN layer's state for batch 1: conv (D, W), recurrent (HV, K, V)."""

    conv_shape: tuple[int, int]
    recurrent_shape: tuple[int, int, int]


@dataclass(frozen=True)
class AttentionStateSpec:
    """One attention layer's KV buffer for batch 1: (KV heads, max_length, head dim) each."""

    kv_shape: tuple[int, int, int]


class AttentionLayerState:
    """A static KV buffer written in place at the cache's device-side position. Entries at or
    past the position are never read (masked), so rolling back is setting the position.
    Two caches may share the buffers (exact and decode engines: the bridge stays O(1))."""

    def __init__(self, spec: AttentionStateSpec, batch_size: int, dtype: torch.dtype,
                 device: torch.device, position: torch.Tensor):
        self.key_cache = torch.zeros(batch_size, *spec.kv_shape, dtype=dtype, device=device)
        self.value_cache = torch.zeros_like(self.key_cache)
        self.position = position  # the owning cache's (device scalar): tokens already stored
        self.has_previous_state = {0: False}
        self.window: int | None = None  # see RecurrentCache.set_window
        self.window_exact = False  # the window ends at the forward's last token (eager)

    @property
    def max_length(self) -> int:
        return self.key_cache.shape[2]

    @property
    def attend_length(self) -> int:
        """How many leading KV entries a forward reads (masked by position within them)."""
        return self.window or self.max_length


class RecurrentLayerState:
    """One GDN layer's state: views into the cache's two flat buffers."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor):
        self.conv_states = {0: conv}  # (B, D, W), activation dtype
        # Recurrent state stays fp32 whatever the activations are, as fla and transformers keep it.
        self.recurrent_states = {0: recurrent}  # (B, HV, K, V)
        self.is_conv_states_initialized = {0: True}
        self.is_recurrent_states_initialized = {0: True}
        self.has_previous_state = {0: False}
        self.tape = None  # a LayerTape while the verifier records (RecurrentCache.recording)
        self.valid = None  # a padded forward's real length (RecurrentCache.counting)


class RecurrentCache:
    """All layers' state for one batch. ``seen_tokens`` counts tokens folded into it."""

    def __init__(self, specs: list[LayerStateSpec], batch_size: int = 1,
                 conv_dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.specs = list(specs)
        self.batch_size = int(batch_size)
        self.conv_dtype = conv_dtype
        self.device = torch.device(device)
        # Tokens stored so far, on the device: attention layers read it inside captured graphs.
        self.position = torch.zeros((), dtype=torch.long, device=self.device)
        # All conv states live in one flat buffer and all recurrent states in another (each
        # layer's tensors are views), so a bridge or a snapshot is two copy kernels, not two
        # per layer.
        gdn = [s for s in specs if isinstance(s, LayerStateSpec)]
        conv_sizes = [batch_size * math.prod(s.conv_shape) for s in gdn]
        rec_sizes = [batch_size * math.prod(s.recurrent_shape) for s in gdn]
        self.conv_buffer = torch.zeros(sum(conv_sizes), dtype=conv_dtype, device=self.device)
        self.recurrent_buffer = torch.zeros(sum(rec_sizes), dtype=torch.float32,
                                            device=self.device)
        conv_views = iter(torch.split(self.conv_buffer, conv_sizes)) if gdn else iter(())
        rec_views = iter(torch.split(self.recurrent_buffer, rec_sizes)) if gdn else iter(())
        self.layers = []
        for spec in specs:
            if isinstance(spec, AttentionStateSpec):
                self.layers.append(AttentionLayerState(spec, batch_size, conv_dtype, self.device,
                                                       self.position))
            else:
                self.layers.append(RecurrentLayerState(
                    next(conv_views).view(batch_size, *spec.conv_shape),
                    next(rec_views).view(batch_size, *spec.recurrent_shape)))
        self.seen_tokens = 0
        self.valid: torch.Tensor | None = None  # see counting

    def reset(self) -> None:
        self.conv_buffer.zero_()
        self.recurrent_buffer.zero_()
        for layer in self.layers:
            layer.has_previous_state[0] = False  # attention KV past the position is invisible
        self.position.zero_()
        self.seen_tokens = 0

    def empty_like(self, share_kv: bool = False) -> RecurrentCache:
        """A new cache of the same shape; ``share_kv`` makes its attention layers use this
        cache's KV buffers (snapshots, the decode engine's cache)."""
        other = RecurrentCache(self.specs, self.batch_size, self.conv_dtype, self.device)
        if share_kv:
            other.share_kv_with(self)
        return other

    def share_kv_with(self, other: RecurrentCache) -> None:
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            if isinstance(mine, AttentionLayerState):
                mine.key_cache, mine.value_cache = theirs.key_cache, theirs.value_cache

    @property
    def has_attention(self) -> bool:
        return any(isinstance(layer, AttentionLayerState) for layer in self.layers)

    # --- the attend window: how much of the static KV buffers a forward reads -------------
    # Several query rows under a mask are SDPA's slow case, and its cost grows with the keys it
    # is given (bench/attention.py: 215 us per layer over a 4k buffer for an 8-token block,
    # 66 us over 512 keys). The host knows how many tokens are stored (seen_tokens), so it can
    # hand a forward only the leading entries it needs: the exact count for eager forwards, a
    # power-of-two bucket for captured graphs (the graph is keyed by it). One-token decode
    # steps keep the whole buffer (None): their kernel (ops.decode_attention) reads the
    # position on the device and stops there, so one graph serves every length; the verifier
    # does the same where that kernel serves all of its forwards (Verifier.one_window).

    MIN_WINDOW = 256

    def set_window(self, length: int | None, exact: bool = False) -> None:
        """Forwards read the first ``length`` KV entries (None: the whole buffer) until reset.
        The caller guarantees length >= tokens stored after the forward; ``exact``: equal to
        it (an eager forward), so the queries are the window's last tokens and attention can
        take the causal kernels instead of a mask (attention.py)."""
        for layer in self.layers:
            if isinstance(layer, AttentionLayerState):
                if length is not None and not 0 < length <= layer.max_length:
                    raise ValueError(f"attend window {length} outside 1..{layer.max_length}")
                layer.window = length
                layer.window_exact = exact and length is not None

    @contextlib.contextmanager
    def attending(self, length: int | None, exact: bool = False):
        """``set_window(length, exact)`` for the body of a with-block (a no-op without
        attention)."""
        if not self.has_attention or length is None:
            yield
            return
        self.set_window(length, exact)
        try:
            yield
        finally:
            self.set_window(None)

    def window_for(self, total: int) -> int | None:
        """The bucket a captured forward that ends with ``total`` stored tokens uses: the next
        power of two >= total (at least MIN_WINDOW, at most the buffer); None without attention
        layers (pure GDN: nothing to key graphs by)."""
        if not self.has_attention:
            return None
        return self.bucket(total, self.max_kv_length)

    @classmethod
    def bucket(cls, total: int, limit: int) -> int:
        """The next power of two >= total, at least MIN_WINDOW, at most ``limit``."""
        return min(limit, max(cls.MIN_WINDOW, 1 << max(total - 1, 0).bit_length()))

    def windows(self) -> list[int | None]:
        """Every bucket window_for can return (capture every graph up front)."""
        if not self.has_attention:
            return [None]
        found, total = [], 1
        while not found or found[-1] < self.max_kv_length:
            found.append(self.window_for(total))
            total = found[-1] + 1
        return found

    @contextlib.contextmanager
    def counting(self, valid: torch.Tensor):
        """Forwards in the body of a with-block are padded: only their first ``valid`` tokens
        count (a 0-d device tensor, so that one captured graph serves every length up to its
        own). GDN layers leave the state as those tokens leave it (later steps masked, the conv
        window taken at ``valid``) and the position advances by ``valid``; attention writes KV
        for the padding too, past the position, where it is never read (unimax.short_prefill)."""
        self.valid = valid
        for layer in self.layers:
            if isinstance(layer, RecurrentLayerState):
                layer.valid = valid
        try:
            yield
        finally:
            self.valid = None
            for layer in self.layers:
                if isinstance(layer, RecurrentLayerState):
                    layer.valid = None

    @contextlib.contextmanager
    def recording(self, tape):
        """GDN layers record their recurrence inputs into ``tape`` (a unimax.tape.Tape) for the
        body of a with-block."""
        for layer, layer_tape in zip(self.layers, tape.layers, strict=True):
            if isinstance(layer, RecurrentLayerState):
                layer.tape = layer_tape
        try:
            yield
        finally:
            for layer in self.layers:
                if isinstance(layer, RecurrentLayerState):
                    layer.tape = None

    @property
    def max_kv_length(self) -> int:
        return min(layer.max_length for layer in self.layers
                   if isinstance(layer, AttentionLayerState))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def __len__(self) -> int:
        return len(self.layers)


def cache_payload_bytes(cache: RecurrentCache) -> int:
    """Bytes of every conv and recurrent state tensor: what a bridge or a snapshot moves."""
    total = 0
    for layer in cache.layers:
        for table in STATE_TABLES:
            for tensor in getattr(layer, table, {}).values():
                if tensor is not None:
                    total += tensor.numel() * tensor.element_size()
    return int(total)


@torch.inference_mode()
def copy_cache_(dst: RecurrentCache, src: RecurrentCache) -> None:
    """Copy src's state and flags into dst's existing storage; dst's addresses are kept."""
    if len(dst.layers) != len(src.layers):
        raise ValueError(f"cache topology mismatch: destination has {len(dst.layers)} layers, "
                         f"source has {len(src.layers)}")
    for index, (d_layer, s_layer) in enumerate(zip(dst.layers, src.layers, strict=True)):
        if isinstance(d_layer, AttentionLayerState):
            _copy_kv_(d_layer, s_layer, index)
        for table in STATE_TABLES:
            d_table, s_table = getattr(d_layer, table, {}), getattr(s_layer, table, {})
            for idx, s_tensor in s_table.items():
                if s_tensor is None:
                    continue
                d_tensor = d_table.get(idx)
                if d_tensor is None:
                    raise RuntimeError(f"destination cache storage is not materialized: "
                                       f"layer {index} {table}[{idx}]")
                if d_tensor.shape != s_tensor.shape or d_tensor.dtype != s_tensor.dtype:
                    raise RuntimeError(
                        f"cache state mismatch for layer {index} {table}[{idx}]: "
                        f"dst={tuple(d_tensor.shape)}/{d_tensor.dtype}, "
                        f"src={tuple(s_tensor.shape)}/{s_tensor.dtype}")
                d_tensor.copy_(s_tensor)
        for table in FLAG_TABLES:
            if hasattr(d_layer, table):
                d_flags = getattr(d_layer, table)
                d_flags.clear()
                d_flags.update(getattr(s_layer, table))
    dst.position.copy_(src.position)
    dst.seen_tokens = int(src.seen_tokens)


def _copy_kv_(dst: AttentionLayerState, src, index: int) -> None:
    """KV is shared between the engines (nothing to copy); a separate buffer gets a copy."""
    if not isinstance(src, AttentionLayerState) or dst.key_cache.shape != src.key_cache.shape:
        raise RuntimeError(f"cache state mismatch for layer {index}: attention KV buffers differ")
    if dst.key_cache.data_ptr() != src.key_cache.data_ptr():
        dst.key_cache.copy_(src.key_cache)
        dst.value_cache.copy_(src.value_cache)


def state_tensors(cache: RecurrentCache) -> list[torch.Tensor]:
    """The fixed-size state: the flat conv and recurrent buffers and the position; what a
    bridge moves. Attention KV is not in it (see ``kv_tensors``)."""
    return [cache.conv_buffer, cache.recurrent_buffer, cache.position]


def kv_tensors(cache: RecurrentCache) -> list[torch.Tensor]:
    return [t for layer in cache.layers if isinstance(layer, AttentionLayerState)
            for t in (layer.key_cache, layer.value_cache)]


class CacheCopier:
    """A validated ``copy_cache_(dst, src)`` for a fixed pair of caches: the shapes are checked
    once, then every call is one fused ``_foreach_copy_`` over all state tensors (a handful of
    kernels instead of two per layer, and no per-tensor Python work): the bridge's hot path.
    ``recurrent=False`` leaves the recurrent states out (the conv states and the position only):
    the verifier's blocks, whose rewind moves the recurrent states itself."""

    def __init__(self, dst: RecurrentCache, src: RecurrentCache, recurrent: bool = True):
        copy_cache_(dst, src)  # validates topology, shapes and dtypes once
        for d, s in zip(kv_tensors(dst), kv_tensors(src), strict=True):
            if d.data_ptr() != s.data_ptr():
                raise ValueError("CacheCopier needs the two caches to share their attention KV "
                                 "buffers (cache.empty_like(share_kv=True)); use copy_cache_")
        self.dst, self.src = dst, src
        self.dst_tensors, self.src_tensors = (
            [t for t in state_tensors(c) if recurrent or t is not c.recurrent_buffer]
            for c in (dst, src))

    @torch.inference_mode()
    def __call__(self) -> None:
        torch._foreach_copy_(self.dst_tensors, self.src_tensors)
        for d_layer, s_layer in zip(self.dst.layers, self.src.layers, strict=True):
            for table in FLAG_TABLES:
                if hasattr(d_layer, table):
                    getattr(d_layer, table).update(getattr(s_layer, table))
        self.dst.seen_tokens = int(self.src.seen_tokens)


def snapshot_cache(cache: RecurrentCache, out: RecurrentCache | None = None) -> RecurrentCache:
    """A copy of the cache's state. Pass ``out`` (e.g. from ``cache.empty_like()``) to reuse
    preallocated buffers instead of allocating on every call."""
    if out is None:
        out = cache.empty_like()
    copy_cache_(out, cache)
    return out


def restore_cache_(cache: RecurrentCache, snapshot: RecurrentCache) -> None:
    """Put a snapshot back into the cache's own storage (addresses kept)."""
    copy_cache_(cache, snapshot)
