"""Child process for the tests: flash-linear-attention's own model writes a checkpoint and computes
reference logits. Runs with fla importable (PYTHONPATH), apart from the pytest process.

fla's layers call Triton kernels that need a GPU, so on the CPU each kernel call is swapped for
fla's own reference where it has one (``naive_recurrent_gated_delta_rule``, ``rms_norm_ref``)
and for the plain formula from fla's docstrings otherwise (causal conv, SwiGLU, the GDN gate).
The model's structure, weight names and wiring stay fla's.

usage: fla_reference.py OUT_DIR SEED CONFIG_JSON IDS_JSON
prints one JSON line; writes OUT_DIR (the checkpoint) and OUT_DIR/reference_logits.pt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def _patch_fla_for_cpu() -> None:
    import fla.layers.gated_deltanet as gdn_layer
    import fla.modules.mlp as fla_mlp
    from fla.modules.norm.fused_norm_gate import FusedRMSNormGated
    from fla.modules.norm.layernorm_gated import rms_norm_ref
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    def causal_conv1d(x, weight, bias=None, activation=None, **_):
        y = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1,
                     groups=weight.shape[0])[..., : x.shape[1]].transpose(1, 2)
        return (F.silu(y) if activation in ("silu", "swish") else y), None

    def gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                         allow_neg_eigval=False, use_gate_in_kernel=False, A_log=None,
                         dt_bias=None, **_):
        if use_qk_l2norm_in_kernel:
            q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
        if use_beta_sigmoid_in_kernel:
            beta = beta.sigmoid() * (2.0 if allow_neg_eigval else 1.0)
        if use_gate_in_kernel:
            g = -A_log.float().exp() * F.softplus(g.float() + dt_bias.float())
        group = v.shape[2] // q.shape[2]
        q, k = (x.repeat_interleave(group, dim=2) for x in (q, k))
        o, _ = naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=initial_state)
        return o.to(v.dtype), None

    def norm_gated_forward(self, x, g, **_):
        if self.activation == "sigmoid":
            gate = g.float().sigmoid().to(x.dtype)
            return rms_norm_ref(x, self.weight, None, eps=self.eps) * gate
        return rms_norm_ref(x, self.weight, None, z=g, eps=self.eps)

    gdn_layer.causal_conv1d = causal_conv1d
    gdn_layer.chunk_gated_delta_rule = gated_delta_rule
    gdn_layer.fused_recurrent_gated_delta_rule = gated_delta_rule
    FusedRMSNormGated.forward = norm_gated_forward
    fla_mlp.swiglu = lambda gate, up: F.silu(gate.float()).to(gate.dtype) * up


def main() -> None:
    out_dir, seed = Path(sys.argv[1]), int(sys.argv[2])
    config_kwargs, ids = json.loads(sys.argv[3]), json.loads(sys.argv[4])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    from helpers import randomize_

    _patch_fla_for_cpu()
    torch.manual_seed(seed)
    # fuse_norm / fuse_swiglu off: the fused variants are Triton-only; the weights are the same.
    config = GatedDeltaNetConfig(fuse_norm=False, fuse_swiglu=False, fuse_cross_entropy=False,
                                 **config_kwargs)
    model = GatedDeltaNetForCausalLM(config).eval()
    randomize_(model, seed)
    model.save_pretrained(out_dir)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids), use_cache=False).logits
    torch.save(logits, out_dir / "reference_logits.pt")
    names = sorted(model.state_dict())
    print(json.dumps({"tensors": len(names), "logits_shape": list(logits.shape)}))


if __name__ == "__main__":
    main()
