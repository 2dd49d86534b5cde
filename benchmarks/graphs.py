"""Graphs the engine benchmarks run on, built the same way for every rewriter.

- `chain(n)`: n nodes of add -> relu -> mul blocks on 8x8 tensors, with
  fake values, built directly (exporting 100k nodes takes minutes).
- `bad_forms_block()`: a real torch.export of one block holding a bad form of
  every seed family the DEFAULT pack fixes; `replicate(block, n)` chains
  copies of its graph to about n nodes (parameters shared), so the 100k-node
  graph has the op mix and bad forms of a real export.
- `BadForms(k)`: k such blocks as one module, for exporting a whole program.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

aten = torch.ops.aten


def chain(n_nodes: int) -> GraphModule:
    """x -> (add w -> relu -> mul w) repeated: n_nodes // 3 blocks."""
    mode = FakeTensorMode()
    graph = Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    with mode:
        val = torch.empty(8, 8)
    x.meta["val"] = w.meta["val"] = val
    cur = x
    for _ in range(n_nodes // 3):
        a = graph.call_function(aten.add.Tensor, (cur, w))
        r = graph.call_function(aten.relu.default, (a,))
        cur = graph.call_function(aten.mul.Tensor, (r, w))
        a.meta["val"] = r.meta["val"] = cur.meta["val"] = val
    graph.output(cur)
    return GraphModule(torch.nn.Module(), graph)


def relu_of_add(x, w):
    return aten.relu.default(aten.add.Tensor(x, w))


def relu_of_sub(x, w):
    return aten.relu.default(aten.sub.Tensor(x, w))


class Block(torch.nn.Module):
    """One bad form per seed family, on a (4, 16) activation."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.bn = torch.nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) + torch.tensor(0.5)  # lift_fresh_copy
        y = self.bn(y)  # batch norm in eval: a composite
        y = y + F.max_pool1d(y.unsqueeze(1), 1).squeeze(1)  # pooling, stride left empty
        with torch.no_grad():  # a set_grad_enabled wrapper in the training IR
            z = y * 2
        z.add_(1)  # in-place on an intermediate
        y = torch.cond(z.sum() > 0, lambda a: a + 1, lambda a: a - 1, (y + z,))  # torch.cond
        y = y - (x.shape[0] - y)  # a SymInt in a tensor slot (rsub)
        return F.dropout(y, 0.1, training=False)


class BadForms(torch.nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*(Block() for _ in range(blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def export_bad_forms(blocks: int) -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    model = BadForms(blocks).eval()
    batch = torch.export.Dim("batch", min=2, max=64)
    return torch.export.export(model, (torch.randn(4, 16),), dynamic_shapes={"x": {0: batch}})


def replicate(ep: torch.export.ExportedProgram, n_nodes: int) -> GraphModule:
    """Chain copies of `ep`'s graph (its last placeholder is the activation,
    its single output the next block's input) until about `n_nodes` nodes.
    Parameters, buffers and constants are placeholders shared by all copies."""
    src = ep.graph_module
    nodes = list(src.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    (output,) = [n for n in nodes if n.op == "output"]
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    graph = Graph()
    env: dict[Node, Node] = {}
    for p in inputs:
        env[p] = graph.placeholder(p.name)
        env[p].meta = copy.copy(p.meta)
    activation = inputs[-1]
    result = env[activation]
    for _ in range(max(1, n_nodes // max(1, len(body)))):
        env[activation] = result
        for n in body:
            env[n] = graph.node_copy(n, env.__getitem__)
        result = map_arg(output.args[0], env.__getitem__)[0]
    graph.output(result)
    gm = GraphModule(src, graph)
    return gm


def export_bert(layers: int) -> torch.export.ExportedProgram:
    """A tiny-width BERT (random weights, transformers config) `layers` deep,
    eager attention (about 85 nodes a layer: 256 layers make ~22k nodes)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    model = BertModel(config).eval()
    ids = torch.randint(0, 128, (1, 16))
    return torch.export.export(model, (ids,), {"attention_mask": torch.ones(1, 16, dtype=torch.long)})
