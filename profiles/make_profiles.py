#!/usr/bin/python3
"""Generate the model profiles that dear-sim replays (profiles/*.json).

Usage: /usr/bin/python3 profiles/make_profiles.py [OUTPUT_DIR]   (default: this folder)

Each profile lists the layers that own parameters, in forward order, with the exact element
count of every parameter tensor and forward/backward times derived from FLOPs:

- Parameter counts are exact: CNNs are instantiated (torchvision, or Inception-v4 written out
  below after Szegedy et al. 2016, since torchvision lacks it) and their tensors are counted;
  BERT is counted by formula from the architecture (BertModel: embeddings, encoder, pooler).
  The totals are checked against the published numbers.
- Times model an RTX 2080 Ti (the DeAR paper's GPU) in fp32: peak 13.4 TFLOP/s, of which
  kFlopEfficiency is sustained by convolutions and GEMMs; 616 GB/s memory bandwidth, of which
  kMemEfficiency is sustained by memory-bound layers (BatchNorm, LayerNorm, embeddings); plus
  a fixed launch overhead per layer. A layer takes max(FLOP time, memory time) + overhead, and
  its backward pass takes kBackwardFactor times its forward pass (two GEMMs instead of one).
  Layers without parameters (activations, pooling) are folded into the memory term of the
  parameterised layer before them by counting their output traffic.
"""
import json
import os
import sys

PEAK_FLOPS = 13.4e12
FLOP_EFFICIENCY = 0.55
PEAK_MEM_BW = 616e9
MEM_EFFICIENCY = 0.70
LAUNCH_OVERHEAD_S = 10e-6
BACKWARD_FACTOR = 2.0
BYTES = 4  # fp32 activations and gradients

DEVICE = {
    "name": "RTX 2080 Ti (modelled)",
    "sustained_tflops": PEAK_FLOPS * FLOP_EFFICIENCY / 1e12,
    "sustained_mem_gbps": PEAK_MEM_BW * MEM_EFFICIENCY / 1e9,
    "launch_overhead_us": LAUNCH_OVERHEAD_S * 1e6,
    "backward_factor": BACKWARD_FACTOR,
}


def layer_time(flops, mem_bytes):
    return max(flops / (PEAK_FLOPS * FLOP_EFFICIENCY),
               mem_bytes / (PEAK_MEM_BW * MEM_EFFICIENCY)) + LAUNCH_OVERHEAD_S


def make_entry(name, tensors, flops, mem_bytes):
    fwd = layer_time(flops, mem_bytes)
    return {"name": name, "params": [int(t) for t in tensors],
            "fwd_ms": round(fwd * 1e3, 6), "bwd_ms": round(fwd * BACKWARD_FACTOR * 1e3, 6),
            "gflops": round(flops / 1e9, 6)}


# ----------------------------------------------------------------------------------- CNNs
def inception_v4():
    import torch.nn as nn
    import torch

    class Conv(nn.Sequential):
        def __init__(self, cin, cout, k, s=1, p=0):
            super().__init__(nn.Conv2d(cin, cout, k, s, p, bias=False),
                             nn.BatchNorm2d(cout, eps=0.001), nn.ReLU(inplace=True))

    class Cat(nn.Module):
        def __init__(self, *branches):
            super().__init__()
            self.branches = nn.ModuleList(branches)

        def forward(self, x):
            return torch.cat([b(x) for b in self.branches], 1)

    class Split(nn.Module):  # a trunk followed by two parallel heads (Inception-C)
        def __init__(self, trunk, a, b):
            super().__init__()
            self.trunk, self.a, self.b = trunk, a, b

        def forward(self, x):
            y = self.trunk(x)
            return torch.cat([self.a(y), self.b(y)], 1)

    S = nn.Sequential
    pool3 = lambda: nn.MaxPool2d(3, 2)
    avg = lambda: nn.AvgPool2d(3, 1, 1, count_include_pad=False)

    def block_a():
        return Cat(Conv(384, 96, 1), S(Conv(384, 64, 1), Conv(64, 96, 3, p=1)),
                   S(Conv(384, 64, 1), Conv(64, 96, 3, p=1), Conv(96, 96, 3, p=1)),
                   S(avg(), Conv(384, 96, 1)))

    def block_b():
        return Cat(Conv(1024, 384, 1),
                   S(Conv(1024, 192, 1), Conv(192, 224, (1, 7), p=(0, 3)),
                     Conv(224, 256, (7, 1), p=(3, 0))),
                   S(Conv(1024, 192, 1), Conv(192, 192, (7, 1), p=(3, 0)),
                     Conv(192, 224, (1, 7), p=(0, 3)), Conv(224, 224, (7, 1), p=(3, 0)),
                     Conv(224, 256, (1, 7), p=(0, 3))),
                   S(avg(), Conv(1024, 128, 1)))

    def block_c():
        return Cat(Conv(1536, 256, 1),
                   Split(Conv(1536, 384, 1), Conv(384, 256, (1, 3), p=(0, 1)),
                         Conv(384, 256, (3, 1), p=(1, 0))),
                   Split(S(Conv(1536, 384, 1), Conv(384, 448, (3, 1), p=(1, 0)),
                           Conv(448, 512, (1, 3), p=(0, 1))),
                         Conv(512, 256, (1, 3), p=(0, 1)), Conv(512, 256, (3, 1), p=(1, 0))),
                   S(avg(), Conv(1536, 256, 1)))

    features = S(
        Conv(3, 32, 3, 2), Conv(32, 32, 3), Conv(32, 64, 3, p=1),
        Cat(pool3(), Conv(64, 96, 3, 2)),
        Cat(S(Conv(160, 64, 1), Conv(64, 96, 3)),
            S(Conv(160, 64, 1), Conv(64, 64, (1, 7), p=(0, 3)), Conv(64, 64, (7, 1), p=(3, 0)),
              Conv(64, 96, 3))),
        Cat(Conv(192, 192, 3, 2), pool3()),
        *[block_a() for _ in range(4)],
        Cat(Conv(384, 384, 3, 2), S(Conv(384, 192, 1), Conv(192, 224, 3, p=1),
                                    Conv(224, 256, 3, 2)), pool3()),
        *[block_b() for _ in range(7)],
        Cat(S(Conv(1024, 192, 1), Conv(192, 192, 3, 2)),
            S(Conv(1024, 256, 1), Conv(256, 256, (1, 7), p=(0, 3)),
              Conv(256, 320, (7, 1), p=(3, 0)), Conv(320, 320, 3, 2)), pool3()),
        *[block_c() for _ in range(3)],
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1536, 1000))
    return features


def profile_cnn(name, net, image, batch, expected_params):
    import torch
    import torch.nn as nn
    net.eval()
    records = []   # [module name, tensors, flops, mem bytes] in execution order
    seen = set()
    names = {m: n for n, m in net.named_modules()}

    def hook(module, inputs, output):
        params = list(module.parameters(recurse=False))
        out = output.numel() * batch
        if not params:
            # Parameterless work (activation, pooling, concat) is charged as memory traffic to
            # the last parameterised layer: it runs between that layer and the next one.
            if records:
                records[-1][3] += 2 * out * BYTES
            return
        if module in seen:
            raise RuntimeError(f"{names[module]} runs twice; profiles assume one call")
        seen.add(module)
        inp = inputs[0].numel() * batch
        if isinstance(module, nn.Conv2d):
            k = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
            flops = 2 * out * k
        elif isinstance(module, nn.Linear):
            flops = 2 * out * module.in_features
        else:  # normalisation: a few operations per element, memory bound
            flops = 5 * out
        weights = sum(p.numel() for p in params)
        records.append([names[module], [p.numel() for p in params], flops,
                        (inp + out + weights) * BYTES])

    handles = [m.register_forward_hook(hook) for m in net.modules()
               if len(list(m.children())) == 0]
    with torch.no_grad():
        net(torch.zeros(1, 3, image, image))
    for h in handles:
        h.remove()
    total = sum(p.numel() for p in net.parameters())
    counted = sum(sum(r[1]) for r in records)
    if total != counted or total != expected_params:
        raise RuntimeError(f"{name}: {counted} counted, {total} in model, "
                           f"{expected_params} expected")
    layers = [make_entry(n, t, f, m) for n, t, f, m in records]
    return {"name": name, "batch_size": batch, "input": f"{image}x{image} images",
            "element_bytes": BYTES, "total_params": total, "layers": layers}


# ----------------------------------------------------------------------------------- BERT
def profile_bert(name, hidden, n_layers, batch, seq, expected_params):
    vocab, max_pos, types = 30522, 512, 2
    inter = 4 * hidden
    tokens = batch * seq
    layers = []

    def linear(lname, fin, fout, extra_flops=0):
        flops = 2 * tokens * fin * fout + extra_flops
        mem = (tokens * (fin + fout) + fin * fout) * BYTES
        layers.append(make_entry(lname, [fout * fin, fout], flops, mem))

    def norm(lname, width):
        layers.append(make_entry(lname, [width, width], 8 * tokens * width,
                                 2 * tokens * width * BYTES))

    def embedding(lname, rows):
        layers.append(make_entry(lname, [rows * hidden], tokens * hidden,
                                 2 * tokens * hidden * BYTES))

    embedding("embeddings.word_embeddings", vocab)
    embedding("embeddings.position_embeddings", max_pos)
    embedding("embeddings.token_type_embeddings", types)
    norm("embeddings.LayerNorm", hidden)
    for i in range(n_layers):
        p = f"encoder.layer.{i}."
        linear(p + "attention.self.query", hidden, hidden)
        linear(p + "attention.self.key", hidden, hidden)
        # The score (QK^T) and context (PV) products and the softmax run between value and
        # the output projection; charge them to the output projection.
        attn = 2 * 2 * tokens * seq * hidden
        linear(p + "attention.self.value", hidden, hidden)
        linear(p + "attention.output.dense", hidden, hidden, extra_flops=attn)
        norm(p + "attention.output.LayerNorm", hidden)
        linear(p + "intermediate.dense", hidden, inter)
        linear(p + "output.dense", inter, hidden)
        norm(p + "output.LayerNorm", hidden)
    # The pooler sees only the first token of each sequence.
    layers.append(make_entry("pooler.dense", [hidden * hidden, hidden],
                             2 * batch * hidden * hidden,
                             (2 * batch * hidden + hidden * hidden) * BYTES))
    total = sum(sum(l["params"]) for l in layers)
    if total != expected_params:
        raise RuntimeError(f"{name}: {total} counted, {expected_params} expected")
    return {"name": name, "batch_size": batch, "input": f"sequences of {seq} tokens",
            "element_bytes": BYTES, "total_params": total, "layers": layers}


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    import torchvision.models as tvm
    # Batch sizes per GPU as in data-parallel training of these models on 11 GB GPUs.
    profiles = [
        profile_cnn("resnet50", tvm.resnet50(), 224, 64, 25557032),
        profile_cnn("densenet201", tvm.densenet201(), 224, 32, 20013928),
        profile_cnn("inceptionv4", inception_v4(), 299, 64, 42679816),
        profile_bert("bert_base", 768, 12, 32, 128, 109482240),
        profile_bert("bert_large", 1024, 24, 8, 128, 335141888),
    ]
    for p in profiles:
        p["device"] = DEVICE
        p["generator"] = "profiles/make_profiles.py"
        fwd = sum(l["fwd_ms"] for l in p["layers"])
        bwd = sum(l["bwd_ms"] for l in p["layers"])
        path = os.path.join(out_dir, p["name"] + ".json")
        with open(path, "w") as f:
            json.dump(p, f, indent=1)
            f.write("\n")
        print(f"{p['name']:12s} {len(p['layers']):4d} layers {p['total_params']:>11,d} params "
              f"fwd {fwd:8.2f} ms bwd {bwd:8.2f} ms -> {path}")


if __name__ == "__main__":
    main()
