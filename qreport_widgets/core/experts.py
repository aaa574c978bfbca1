"""A mixture of experts' 3-d expert weights as one ``nn.Linear`` an expert, in the session's copy.

transformers keeps a mixture of experts' projections as two 3-d parameters of one module
(Qwen3-MoE's, Qwen2-MoE's, Mixtral's, OLMoE's ``experts``): ``gate_up_proj`` (experts x 2 * inner x
width) and ``down_proj`` (experts x width x inner), called with the hidden states, each token's
chosen experts and their weights. They are most of such a model's bytes, and every quantization
step here takes ``nn.Linear`` modules. The session's copy (``memory.WatchedCopy``) holds such a
module as ``ExpertLinears``: one ``nn.Linear`` for each expert's ``gate_up_proj`` and one for its
``down_proj``, each weight a *view* of the user's (the same storage, no copy), the module path
unchanged (``...experts.gate_up_proj.3`` is expert 3's). Each expert reads only the tokens routed
to it, as transformers computes it, so GPTQ and AWQ see each expert's own inputs; exported (a
program), every expert runs on every token, weighted by its routing weight (0 where it was not
chosen): the same outputs, from ops a program can hold.

A module is taken only where it has that layout and gives the same outputs as its own forward on a
random routing (``is_expert_weights``); anything else is left as it is, and the session names its
weights among those no tunable module holds.
"""

from __future__ import annotations

import torch
from torch import nn

from .linears import replaced_in_place

CHECK_TOKENS = 6  # tokens of the random routing a module is checked on


class ExpertLinears(nn.Module):
    """The experts of ``module`` (``is_expert_weights``) as ``nn.Linear`` modules over its weights."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        experts, inner2, width = module.gate_up_proj.shape
        self.num_experts = experts
        self.act_fn = module.act_fn
        self.gate_up_proj = nn.ModuleList(_linear_over(module.gate_up_proj[e]) for e in range(experts))
        self.down_proj = nn.ModuleList(_linear_over(module.down_proj[e]) for e in range(experts))
        self.train(module.training)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting() or isinstance(hidden_states, torch.fx.Proxy):
            return self._every_expert(hidden_states, top_k_index, top_k_weights)
        return self._routed(hidden_states, top_k_index, top_k_weights)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj[e](x).chunk(2, dim=-1)
        return self.down_proj[e](self.act_fn(gate) * up)

    def _routed(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Each expert on the tokens routed to it (an index of ``num_experts`` routes nowhere)."""
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            if len(token) == 0:
                continue
            found = self._expert(e, hidden_states[token]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, found.to(out.dtype))
        return out

    def _every_expert(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by its routing weight: no shape depends on the routing."""
        rows = hidden_states.shape[0]
        # one column more for the index that routes nowhere (``num_experts``), left out of the sum
        weights = torch.zeros(rows, self.num_experts + 1, dtype=top_k_weights.dtype, device=hidden_states.device)
        weights = weights.scatter(1, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            out = out + (self._expert(e, hidden_states) * weights[:, e, None]).to(out.dtype)
        return out


def _linear_over(weight: torch.Tensor) -> nn.Linear:
    """An ``nn.Linear`` whose weight is ``weight`` (outputs x inputs, a view of the user's tensor)."""
    outputs, inputs = weight.shape
    linear = nn.Linear(inputs, outputs, bias=False, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return linear


def is_expert_weights(module: nn.Module) -> bool:
    """Whether ``module`` holds a mixture of experts' weights as two 3-d parameters, ``gate_up_proj``
    (experts x 2 * inner x width) and ``down_proj`` (experts x width x inner), with nothing else
    (no biases), and ``ExpertLinears`` over them gives its outputs on a random routing."""
    gate_up = module._parameters.get("gate_up_proj")
    down = module._parameters.get("down_proj")
    if gate_up is None or down is None or set(module._parameters) != {"gate_up_proj", "down_proj"}:
        return False
    if gate_up.dim() != 3 or down.dim() != 3 or not hasattr(module, "act_fn"):
        return False
    if list(module.children()) not in ([], [module.act_fn]):
        return False
    experts, inner2, width = gate_up.shape
    if inner2 % 2 or tuple(down.shape) != (experts, width, inner2 // 2) or gate_up.device.type == "meta":
        return False
    return _same_outputs(module)


def _same_outputs(module: nn.Module) -> bool:
    experts, _, width = module.gate_up_proj.shape
    chosen = min(2, experts)
    generator = torch.Generator().manual_seed(0)
    dtype, device = module.gate_up_proj.dtype, module.gate_up_proj.device
    hidden = torch.randn(CHECK_TOKENS, width, generator=generator).to(device, dtype)
    index = torch.stack([torch.randperm(experts, generator=generator)[:chosen] for _ in range(CHECK_TOKENS)]).to(device)
    weights = torch.rand(CHECK_TOKENS, chosen, generator=generator).to(device, dtype)
    try:
        with torch.no_grad():
            expected = module(hidden, index, weights)
            found = ExpertLinears(module)(hidden, index, weights)
    except Exception:
        return False
    if not isinstance(expected, torch.Tensor) or expected.shape != found.shape:
        return False
    return bool(torch.allclose(expected, found, rtol=1e-4, atol=1e-5))


def experts_in_place(model: nn.Module) -> list[str]:
    """Replaces, in ``model`` (a copy: its modules are changed), every module ``is_expert_weights``
    takes by ``ExpertLinears`` over its weights; their paths, in order."""
    return replaced_in_place(model, is_expert_weights, ExpertLinears)


def experts_words(names: list[str], experts: int) -> str:
    """What a run's notes say of the modules ``experts_in_place`` turned."""
    shown = ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
    return (
        f"the experts of {len(names)} mixture-of-experts layers ({shown}) are quantized one Linear an expert "
        f"({experts} experts a layer: gate_up_proj.N and down_proj.N), over the same weights"
    )
