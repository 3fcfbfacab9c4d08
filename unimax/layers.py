"""Modules of a pure Gated DeltaNet LM: norms, the GDN token mixer, the SwiGLU MLP, a block.

The mixer reads its input once through a merged projection (q, k, v, z, b, a rows side by side):
one GEMV per token instead of six, which is what batch-1 decoding pays for. Checkpoint adapters
(checkpoint.py) build the merged weights from either layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .attention import GatedAttention
from .cache import RecurrentLayerState
from .config import GDNConfig
from .norms import GatedRMSNorm, RMSNorm, swiglu
from .ops import block_mixer
from .ops.block_mixer import gdn_block_record
from .ops.conv import LONG, causal_conv1d, causal_conv1d_long, causal_conv1d_step, conv_window_after
from .ops.decode_step import decay, gdn_decode_step, write_strength
from .ops.gated_delta import first_steps_only, gated_delta_rule
from .ops.short_recurrence import SHORT_MAX


class GatedDeltaNetMixer(nn.Module):
    # Plain decode steps as one op (ops.decode_step); bench/profile_step.py's "-unfused"
    # variants turn it off on a view to time the torch forms beside it.
    decode_op = True
    def __init__(self, config: GDNConfig):
        super().__init__()
        self.config = config
        self.in_proj = nn.Linear(config.hidden_size, sum(config.in_proj_sizes), bias=False)
        self.conv_weight = nn.Parameter(torch.empty(config.conv_dim, config.conv_size))
        self.A_log = nn.Parameter(torch.empty(config.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(config.num_v_heads))
        self.norm = GatedRMSNorm(config.head_v_dim, config.norm_eps, config.gate_activation)
        self.out_proj = nn.Linear(config.value_dim, config.hidden_size, bias=False)
        self.backend = "auto"  # gated delta rule kernel: see ops.gated_delta.gated_delta_rule

    def forward(self, x: torch.Tensor, state: RecurrentLayerState | None) -> torch.Tensor:
        seq_len = x.shape[1]
        if seq_len > LONG and type(self.in_proj) is nn.Linear:
            return self._gated_out(*self._core(*self._project_prompt(x), state))
        projected = self.in_proj(x)
        if self._one_op_step(state, seq_len):
            return self._gated_out(*self.decode_core(projected, state))
        return self._gated_out(*self.core(projected, state))

    def core(self, projected: torch.Tensor, state: RecurrentLayerState | None):
        """From the in-projection's output (B, T, .) to the recurrence's output o (B, T, HV, V)
        and the gate z, the states updated (or, recording, the tape written): the forward's
        middle for any T up to LONG, shared with the fused block (unimax.fused_draft), which
        folds the norms around it into the projections (``decode_core``: the one-op step)."""
        return self._core(*self._split(projected), state)

    def _core(self, mixed, z, b, a, state: RecurrentLayerState | None,
              tape_written: bool = False):
        cfg = self.config
        batch, seq_len, _ = mixed.shape
        if self._block_record(mixed, state):
            # the tape written by one op (``tape_written``: by the in-projection's, the verifier
            # view's ops.in_proj_tape); the recurrence reads it there, as the rewind does
            if not tape_written:
                gdn_block_record(mixed, a, b, state.conv_states[0], self.conv_weight,
                                 self.A_log, self.dt_bias, *state.tape.buffers,
                                 cfg.allow_neg_eigval)
            o, _ = gated_delta_rule(*state.tape.recurrence_inputs(seq_len),
                                    state.recurrent_states[0], backend=self.backend,
                                    final_state=False)
            state.has_previous_state[0] = True
            return o, z
        if state is None:
            conv_state = mixed.new_zeros(batch, cfg.conv_dim, cfg.conv_size)
            recurrent_state = None
        else:
            conv_state, recurrent_state = state.conv_states[0], state.recurrent_states[0]
            if torch.is_grad_enabled():  # autograd saves what it reads; the cache is overwritten
                conv_state, recurrent_state = conv_state.clone(), recurrent_state.clone()
        conv = (causal_conv1d_step if seq_len == 1 else
                causal_conv1d if seq_len <= LONG else causal_conv1d_long)
        conv_input = mixed
        sizes = [cfg.key_dim, cfg.key_dim, cfg.value_dim]
        if conv is causal_conv1d_long:
            # q, k and v convolved one by one, so that each comes out of the kernel contiguous:
            # split after one convolution they were strided views, copied for the chunk kernel
            # (a 16k prefill at 0.8B spent 7.5 ms of 68 in 96 BF16 copies on the H200, 54 of
            # them these by count). Channels are independent: the same numbers.
            parts = [conv(*part) for part in zip(mixed.split(sizes, -1),
                                                 self.conv_weight.split(sizes),
                                                 conv_state.split(sizes, 1), strict=True)]
            q, k, v = (y for y, _ in parts)
            new_conv_state = torch.cat([window for _, window in parts], dim=1)
        else:
            mixed, new_conv_state = conv(mixed, self.conv_weight, conv_state)
            q, k, v = torch.split(mixed, sizes, dim=-1)
        valid = None if state is None else state.valid
        if valid is not None:  # a padded forward (RecurrentCache.counting): the window after
            new_conv_state = conv_window_after(conv_state, conv_input, valid)  # the real inputs

        q = q.reshape(batch, seq_len, cfg.num_k_heads, cfg.head_k_dim)
        k = k.reshape(batch, seq_len, cfg.num_k_heads, cfg.head_k_dim)
        v = v.reshape(batch, seq_len, cfg.num_v_heads, cfg.head_v_dim)
        recording = state is not None and state.tape is not None
        if not recording:  # (recording, the tape's copies are what the recurrence reads)
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        beta = write_strength(b, cfg.allow_neg_eigval)
        g = decay(a, self.A_log, self.dt_bias)  # the per-head log-decay, in fp32
        if valid is not None:  # the padding's steps change nothing (their outputs are unread)
            g, beta = first_steps_only(g, beta, valid)

        # A recording forward (the verifier's, unimax.tape) leaves the state to the rewind that
        # follows it, which writes the state after the accepted prefix from the tape anyway:
        # writing the state after every drafted token first would only be overwritten. Its
        # recurrence reads the tape's copies of its inputs: one copy of q, k and v per block,
        # not a contiguous one for the kernel and another for the tape (the verify block had
        # ~17 small kernels per layer: bench/RESULTS.md).
        if recording:
            q, k, v, g, beta = state.tape.record(conv_input, q, k, v, g, beta)
        o, new_recurrent_state = gated_delta_rule(q, k, v, g, beta, recurrent_state,
                                                  backend=self.backend,
                                                  final_state=not recording)
        if state is not None:
            if not recording:
                # copy_ into the cache's own storage: captured graphs keep pointing at it. The
                # cache is state, not part of any autograd graph: written under no_grad, so a
                # caller in default grad mode (as transformers users call a model) can use it.
                with torch.no_grad():
                    state.conv_states[0].copy_(new_conv_state)
                    state.recurrent_states[0].copy_(new_recurrent_state)
            state.has_previous_state[0] = True
        return o, z

    def _split(self, projected: torch.Tensor):
        """The in-projection's output -> mixed (q, k, v before the conv), z, b, a."""
        cfg = self.config
        return torch.split(projected, [cfg.conv_dim, cfg.value_dim, cfg.num_v_heads,
                                       cfg.num_v_heads], dim=-1)

    def _project_prompt(self, x: torch.Tensor):
        """The in-projection of a prompt as three products with row blocks of the one weight,
        [q k v], [z], [b a]: z then comes out contiguous, where as a column slice of one product
        fla's gated norm copied it (T x value_dim per layer; its inputs are made contiguous).
        The q/k/v block is read in place by the convolution either way."""
        cfg = self.config
        blocks = self.in_proj.weight.split([cfg.conv_dim, cfg.value_dim, 2 * cfg.num_v_heads])
        mixed, z, ba = (F.linear(x, block) for block in blocks)
        b, a = ba.split(cfg.num_v_heads, dim=-1)
        return mixed, z, b, a

    def decode_core(self, projected: torch.Tensor, state: RecurrentLayerState,
                    beta_in_kernel: bool = False, conv_done: bool = False,
                    beta_done: bool = False):
        """A plain decode step (``_one_op_step``) from the in-projection's output to the
        recurrence's output o (B, 1, HV, V) and the gate z, both states updated: the
        convolution and the gated delta rule as one op (ops.decode_step). Shared by the
        forward and the draft's fused block (unimax.fused_draft), which asks for
        ``beta_in_kernel``: sigmoid(b) inside the recurrence's kernel, in fp32, one launch
        fewer (not with allow_neg_eigval); ``conv_done``: the projection's [q k v] channels
        are already the convolution's output, its state rolled (ops.in_proj_conv);
        ``beta_done``: the b channels already hold beta (write_strength's, ops.in_proj_conv's
        beta epilogue)."""
        cfg = self.config
        mixed, z, b, a = self._split(projected)
        in_kernel = beta_in_kernel and not cfg.allow_neg_eigval and not beta_done
        beta = b if in_kernel or beta_done else write_strength(b, cfg.allow_neg_eigval)
        o = gdn_decode_step(mixed, a, beta, state.conv_states[0], self.conv_weight,
                            state.recurrent_states[0], self.A_log, self.dt_bias,
                            cfg.num_k_heads, in_kernel, conv_done)
        state.has_previous_state[0] = True
        return o, z

    def _block_record(self, mixed: torch.Tensor, state: RecurrentLayerState | None) -> bool:
        """Whether this forward is the verifier's recording block of one sequence, its tape
        written by one op (ops.block_mixer): on CUDA with fla's kernels, 2 to SHORT_MAX
        tokens, not padded, outside autograd, with the default kernels, and the kernel
        configuration's ``block_op`` on."""
        return (kernels.active().block_op and state is not None and state.tape is not None
                and state.valid is None and mixed.shape[0] == 1
                and 1 < mixed.shape[1] <= SHORT_MAX
                and not torch.is_grad_enabled() and self.backend in ("auto", "fla")
                and block_mixer.usable(mixed))

    def _one_op_step(self, state: RecurrentLayerState | None, seq_len: int) -> bool:
        """Whether this forward is a plain decode step, run as one op (ops.decode_step): one
        token on a cache, not recorded for a rewind, not padded, outside autograd (the op has
        no backward), with the default kernels."""
        return (self.decode_op and seq_len == 1 and state is not None and state.tape is None
                and state.valid is None and not torch.is_grad_enabled()
                and self.backend in ("auto", "fla"))

    def _gated_out(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o (B, T, HV, V) through the gated norm (gate z) and the out-projection."""
        batch, seq_len = o.shape[:2]
        z = z.reshape(*o.shape)
        return self.out_proj(self.norm(o, z).reshape(batch, seq_len, self.config.value_dim))



class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up merged into one projection."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(swiglu(gate, up))


class GDNBlock(nn.Module):
    """norm -> token mixer -> residual, norm -> MLP -> residual. The mixer is a GDN layer, or in
    hybrid models gated attention (unimax.attention).

    A fast step's view folds its blocks' norms, gates and residual adds into their GEMVs by
    giving them unimax.fused_draft's FusedBlock class (``fused`` True there); the exact model's
    blocks stay as they are."""

    fused = False
    beta_in_kernel = True  # (fused blocks: see fused_draft.fuse_blocks)

    def __init__(self, config: GDNConfig, attention: bool = False):
        super().__init__()
        self.mixer_norm = RMSNorm(config.hidden_size, config.norm_eps, config.norm_offset)
        if attention:
            self.mixer = GatedAttention(config)
        else:
            self.mixer = GatedDeltaNetMixer(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps, config.norm_offset)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, state: RecurrentLayerState | None) -> torch.Tensor:
        return self.mlp_part(self.mixer_part(x, state))

    def mixer_part(self, x: torch.Tensor, state: RecurrentLayerState | None) -> torch.Tensor:
        return x + self.mixer(self.mixer_norm(x), state)

    def mlp_part(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.mlp_norm(x))
