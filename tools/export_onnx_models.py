"""Exports the ONNX test models Kiln's importer is checked on, with ONNX Runtime's outputs.

The models are the real PyTorch/torchvision architectures (LeNet, ResNet, ResNeXt-style
bottleneck, MobileNet v2/v3, EfficientNet, SqueezeNet, DenseNet, ShuffleNet v2, RegNet,
ConvNeXt, ViT), a BERT-style encoder and a small segmentation head, at reduced width and resolution with seeded
random weights, so that together they stay a few MB in the repository. Each is exported by
`torch.onnx.export` the way a user would (TorchScript exporter, opset 17, dynamic batch; one
model also through the dynamo exporter, opset 18), so the files carry what real exports carry:
Constant and Identity nodes, Shape/Gather/Concat chains, ceil-mode pooling, Erf-based GELU.

For every model the script writes `NAME.onnx` and `NAME.ref.safetensors`: seeded inputs at
batch 1 and batch 3 and ONNX Runtime's outputs for them (tensors named `b{batch}.in.{input}`
and `b{batch}.out.{index}`), which `crates/kiln/tests/onnx_models.rs` compares Kiln against.

Run with the peers' venv (`../shared/peers/setup.sh`, plus torchvision):
    python tools/export_onnx_models.py models/onnx

`--full DIR` instead exports the families at their published sizes (224x224, 1000 classes,
BERT-base-sized encoder at sequence 128; random weights, ~400 MB) for `kiln bench --onnx`
(bench/onnx_models.sh); those are benchmark inputs, not committed.
"""

import json
import os
import struct
import sys

import numpy as np
import onnxruntime as ort
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torchvision.models import resnet as tv_resnet
from torchvision.models.convnext import CNBlockConfig, ConvNeXt
from torchvision.models.densenet import DenseNet
from torchvision.models.efficientnet import EfficientNet, _efficientnet_conf
from torchvision.models.regnet import BlockParams, RegNet
from torchvision.models.shufflenetv2 import ShuffleNetV2
from torchvision.models.vision_transformer import VisionTransformer


class SmallResNet(tv_resnet.ResNet):
    """torchvision's ResNet with its stage widths scaled down (torchvision fixes 64..512)."""

    def __init__(self, block, layers, widths, num_classes=10, groups=1, width_per_group=64):
        nn.Module.__init__(self)
        self._norm_layer = nn.BatchNorm2d
        self.inplanes = widths[0]
        self.dilation = 1
        self.groups = groups
        self.base_width = width_per_group
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, widths[0], layers[0])
        self.layer2 = self._make_layer(block, widths[1], layers[1], stride=2)
        self.layer3 = self._make_layer(block, widths[2], layers[2], stride=2)
        self.layer4 = self._make_layer(block, widths[3], layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[3] * block.expansion, num_classes)


class BertLike(nn.Module):
    """A BERT-style encoder written as BERT is: token, position and segment embeddings,
    post-norm blocks with an additive attention mask, erf GELU, a pooled [CLS] head."""

    def __init__(self, vocab=100, hidden=32, heads=4, layers=2, ffn=64, max_len=64, classes=3):
        super().__init__()
        self.heads = heads
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_len, hidden)
        self.segment = nn.Embedding(2, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                dict(
                    q=nn.Linear(hidden, hidden),
                    k=nn.Linear(hidden, hidden),
                    v=nn.Linear(hidden, hidden),
                    o=nn.Linear(hidden, hidden),
                    norm1=nn.LayerNorm(hidden, eps=1e-12),
                    up=nn.Linear(hidden, ffn),
                    down=nn.Linear(ffn, hidden),
                    norm2=nn.LayerNorm(hidden, eps=1e-12),
                )
            )
            for _ in range(layers)
        )
        self.pool = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def split(self, x):
        b, t, d = x.shape
        return x.view(b, t, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, input_ids, attention_mask):
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t)
        segments = torch.zeros_like(input_ids)
        x = self.norm(self.word(input_ids) + self.position(positions) + self.segment(segments))
        mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
        for blk in self.blocks:
            q, k, v = self.split(blk["q"](x)), self.split(blk["k"](x)), self.split(blk["v"](x))
            scores = q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5) + mask
            ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)
            x = blk["norm1"](x + blk["o"](ctx))
            x = blk["norm2"](x + blk["down"](F.gelu(blk["up"](x))))
        pooled = torch.tanh(self.pool(x[:, 0]))
        return self.head(pooled), x


class SegHead(nn.Module):
    """A small encoder-decoder segmentation net: strided convs down, a transposed conv and a
    bilinear resize up, a skip connection concatenated, a nearest-resized auxiliary output."""

    def __init__(self, classes=4):
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.down2 = nn.Sequential(nn.Conv2d(8, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.ReLU())
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.fuse = nn.Conv2d(16, 8, 3, padding=1)
        self.out = nn.Conv2d(8, classes, 1)
        self.aux = nn.Conv2d(16, classes, 1)

    def forward(self, x):
        s1 = self.down1(x)
        s2 = self.down2(s1)
        y = torch.cat([self.up(s2), s1], dim=1)
        y = F.relu(self.fuse(y))
        y = F.interpolate(self.out(y), scale_factor=2.0, mode="bilinear", align_corners=False)
        aux = F.interpolate(self.aux(s2), size=(x.shape[2], x.shape[3]), mode="nearest")
        return y, aux


class OpMix(nn.Module):
    """Operators the families above do not export, as PyTorch writes them: Split (chunk and
    split with sizes), Pad (reflect and constant), AveragePool with padding in ceil mode not
    counting the pad, dilated and asymmetrically padded convolutions, GlobalMaxPool, Where,
    Max/Min, ReduceSum/ReduceMax, LeakyReLU, Softplus, ArgMax."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=(1, 2), dilation=(1, 2))
        self.b = nn.Conv2d(4, 8, 3, stride=2)
        self.head = nn.Linear(16, 6)

    def forward(self, x):
        y = self.a(F.pad(x, (1, 2, 0, 1), mode="reflect"))
        p, q = torch.chunk(y, 2, dim=1)
        y = p * torch.sigmoid(q)
        y = F.avg_pool2d(y, 3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)
        y = F.pad(y, (1, 1, 1, 1), value=0.5)
        y = F.leaky_relu(self.b(y), 0.1)
        u, v, w = torch.split(y, [2, 2, 4], dim=1)
        z = torch.cat([torch.maximum(u, v), torch.minimum(u, v), F.softplus(w)], dim=1)
        pooled = torch.cat([F.adaptive_max_pool2d(z, 1).flatten(1), z.sum(dim=(2, 3))], dim=1)
        pooled = torch.where(pooled > 0, pooled, pooled * 0.3)
        logits = self.head(pooled)
        return logits, logits.argmax(dim=1)


class LeNet(nn.Module):
    """A LeNet/VGG-style stack: each convolution followed by ReLU and a 2x2 max pool (odd
    sizes, so each pool drops a row and a column), then Flatten and two linear layers: the
    blocks Kiln fuses into one pooled convolution, and the Flatten of a feature map."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 8, 3), nn.Conv2d(8, 16, 3)
        self.f1, self.f2 = nn.Linear(16 * 5 * 5, 32), nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2).flatten(1)
        return self.f2(F.relu(self.f1(x)))


def image_models():
    """(name, model, input shape without batch) for the classification families."""
    tv = torchvision.models
    eff_setting, eff_last = _efficientnet_conf("efficientnet_b0", width_mult=0.25, depth_mult=0.25)
    return [
        ("resnet", SmallResNet(tv_resnet.BasicBlock, [2, 1, 1, 1], [16, 32, 64, 128]), (3, 32, 32)),
        (
            "resnext",
            SmallResNet(tv_resnet.Bottleneck, [1, 1, 1, 1], [8, 16, 32, 64], groups=4, width_per_group=8),
            (3, 32, 32),
        ),
        ("mobilenet_v2", tv.mobilenet_v2(width_mult=0.25, num_classes=10), (3, 32, 32)),
        ("mobilenet_v3", tv.mobilenet_v3_small(width_mult=0.25, num_classes=10), (3, 32, 32)),
        ("efficientnet", EfficientNet(eff_setting, 0.2, 0.2, num_classes=10, last_channel=eff_last), (3, 32, 32)),
        ("squeezenet", tv.squeezenet1_1(num_classes=10), (3, 48, 48)),
        ("densenet", DenseNet(8, (2, 2, 2), 16, num_classes=10), (3, 32, 32)),
        ("shufflenet", ShuffleNetV2([2, 2, 2], [8, 16, 32, 64, 128], num_classes=10), (3, 32, 32)),
        (
            "regnet",
            RegNet(BlockParams.from_init_params(4, 16, 8.0, 2.0, 8, se_ratio=0.25), num_classes=10),
            (3, 32, 32),
        ),
        (
            "convnext",
            ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, 64, 1), CNBlockConfig(64, None, 1)], num_classes=10),
            (3, 32, 32),
        ),
        (
            "vit",
            VisionTransformer(32, 8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10),
            (3, 32, 32),
        ),
    ]


def make_nontrivial(model, gen, shape):
    """Weights that make every layer matter, as a trained net's do. Fresh torchvision models
    have identity BatchNorms and zero-initialized heads and biases, and deep ones at random
    init give nearly the same logits for every input, which would match a runtime with a
    broken layer. So: zero parameters get small random values, BatchNorm affine terms are
    randomized, and BatchNorm statistics are calibrated on a random batch (one train-mode
    pass with cumulative averaging) so activations keep their scale through the depth."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
        for m in norms:
            m.weight.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            m.bias.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            m.reset_running_stats()
            m.momentum = None
        if norms:
            model.train()
            model(torch.randn(16, *shape, generator=gen))
        model.eval()


def save_safetensors(path, tensors):
    """Writes `tensors` (name -> numpy array) in the safetensors format."""
    dtypes = {np.dtype("float32"): "F32", np.dtype("int64"): "I64"}
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        data = array.tobytes()
        header[name] = {
            "dtype": dtypes[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def reference(path, feeds_by_batch):
    """ONNX Runtime's outputs (1 thread, CPU) for each batch's inputs."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    tensors = {}
    for batch, feeds in feeds_by_batch.items():
        for name, value in feeds.items():
            tensors[f"b{batch}.in.{name}"] = value
        for i, out in enumerate(session.run(None, feeds)):
            tensors[f"b{batch}.out.{i}"] = np.asarray(out)
    return tensors


def export(model, args, names, outputs, dynamic, path, dynamo=False, fold=True, opset=17):
    model.eval()
    if dynamo:
        batch = torch.export.Dim("batch", min=1, max=64)
        shapes = tuple({0: batch} for _ in names)
        torch.onnx.export(
            model, args, path, input_names=names, output_names=outputs, dynamic_shapes=shapes, dynamo=True,
            opset_version=18, external_data=False,
        )
    else:
        torch.onnx.export(
            model, args, path, input_names=names, output_names=outputs, dynamic_axes=dynamic,
            opset_version=opset, dynamo=False, do_constant_folding=fold,
        )


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    # nn.MultiheadAttention's fused inference kernel has no ONNX export; the plain path exports
    # the MatMul/Softmax graph every exporter writes for attention.
    torch.backends.mha.set_fastpath_enabled(False)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    jobs = []
    for name, model, shape in image_models():
        make_nontrivial(model, gen, shape)
        # The TorchScript exporter writes ViT's attention reshapes with shapes whose length
        # neither it nor ONNX shape inference declares, which onnx-ir refuses (it needs every
        # tensor's rank); the dynamo exporter, torch's default, declares them.
        jobs.append((name, model, shape, name == "vit"))
    resnet = jobs[0][1]
    jobs.append(("resnet_dynamo", resnet, (3, 32, 32), True))
    # Without the exporter's constant folding, BatchNorm stays a node after each Conv (as
    # other exporters and training-mode exports leave it): the input of Kiln's fold pass.
    jobs.append(("resnet_unfolded", resnet, (3, 32, 32), "unfolded"))
    jobs.append(("opmix", OpMix(), (3, 23, 23), False))  # odd: ceil mode matters
    seg = SegHead()
    make_nontrivial(seg, gen, (3, 32, 32))
    jobs.append(("seghead", seg, (3, 32, 32), False))

    for name, model, shape, dynamo in jobs:
        path = os.path.join(out_dir, f"{name}.onnx")
        outputs = {"seghead": ["out", "aux"], "opmix": ["logits", "label"]}.get(name, ["logits"])
        dynamic = {"input": {0: "batch"}, **{o: {0: "batch"} for o in outputs}}
        with torch.no_grad():
            # OpMix at opset 19: AveragePool's ceil mode means PyTorch's window clipping only
            # from 19 on (ONNX Runtime's older kernel divides the clipped edge window by the
            # whole kernel), and onnx-ir refuses ceil_mode below 19 for that reason.
            export(model.eval(), (torch.randn(2, *shape),), ["input"], outputs, dynamic, path,
                   dynamo is True, fold=dynamo != "unfolded", opset=19 if name == "opmix" else 17)
        feeds = {b: {"input": rng.standard_normal((b, *shape), dtype=np.float32)} for b in (1, 3)}
        save_safetensors(os.path.join(out_dir, f"{name}.ref.safetensors"), reference(path, feeds))
        print(f"{name}: {os.path.getsize(path) / 1e6:.2f} MB")

    bert = BertLike().eval()
    path = os.path.join(out_dir, "bert.onnx")
    ids = torch.randint(0, 100, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    dynamic = {
        "input_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "seq"},
        "logits": {0: "batch"},
        "hidden": {0: "batch", 1: "seq"},
    }
    with torch.no_grad():
        export(bert, (ids, mask), ["input_ids", "attention_mask"], ["logits", "hidden"], dynamic, path)
    feeds = {}
    for b, t in ((1, 16), (3, 11)):
        m = np.ones((b, t), dtype=np.int64)
        m[:, t - 3 :] = 0  # padding at the end, masked out
        feeds[b] = {"input_ids": rng.integers(0, 100, (b, t), dtype=np.int64), "attention_mask": m}
    save_safetensors(os.path.join(out_dir, "bert.ref.safetensors"), reference(path, feeds))
    print(f"bert: {os.path.getsize(path) / 1e6:.2f} MB")
    lenet(out_dir)


def lenet(out_dir):
    """The LeNet model, with seeds of its own (added after the others: their files stay as
    they were)."""
    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(1)
    shape = (1, 29, 29)
    model = LeNet()
    make_nontrivial(model, gen, shape)
    path = os.path.join(out_dir, "lenet.onnx")
    dynamic = {"input": {0: "batch"}, "logits": {0: "batch"}}
    with torch.no_grad():
        export(model.eval(), (torch.randn(2, *shape),), ["input"], ["logits"], dynamic, path)
    feeds = {b: {"input": rng.standard_normal((b, *shape), dtype=np.float32)} for b in (1, 3)}
    save_safetensors(os.path.join(out_dir, "lenet.ref.safetensors"), reference(path, feeds))
    print(f"lenet: {os.path.getsize(path) / 1e6:.2f} MB")


def full_size(out_dir):
    """The families at their published sizes, for benchmarking (not committed)."""
    os.makedirs(out_dir, exist_ok=True)
    torch.backends.mha.set_fastpath_enabled(False)
    torch.manual_seed(0)
    tv = torchvision.models
    jobs = [
        ("resnet18", tv.resnet18(), False),
        ("resnet50", tv.resnet50(), False),
        ("mobilenet_v2", tv.mobilenet_v2(), False),
        ("mobilenet_v3_small", tv.mobilenet_v3_small(), False),
        ("efficientnet_b0", tv.efficientnet_b0(), False),
        ("squeezenet1_1", tv.squeezenet1_1(), False),
        ("densenet121", tv.densenet121(), False),
        ("shufflenet_v2", tv.shufflenet_v2_x1_0(), False),
        ("regnet_y_400mf", tv.regnet_y_400mf(), False),
        ("convnext_tiny", tv.convnext_tiny(), False),
        ("vit_b_16", tv.vit_b_16(), True),
    ]
    dynamic = {"input": {0: "batch"}, "logits": {0: "batch"}}
    gen = torch.Generator().manual_seed(0)
    for name, model, dynamo in jobs:
        path = os.path.join(out_dir, f"{name}.onnx")
        with torch.no_grad():
            # ViT's head starts at zero: logits that are zero for every input compare equal
            # to anything.
            for p in model.parameters():
                if not p.any():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            # Batch 2, not 1: torch.export specializes a size-1 axis to a constant.
            export(model.eval(), (torch.randn(2, 3, 224, 224),), ["input"], ["logits"], dynamic, path, dynamo)
        print(f"{name}: {os.path.getsize(path) / 1e6:.1f} MB")
    bert = BertLike(vocab=30522, hidden=768, heads=12, layers=12, ffn=3072, max_len=512, classes=2).eval()
    path = os.path.join(out_dir, "bert_base.onnx")
    ids, mask = torch.randint(0, 30522, (1, 128)), torch.ones(1, 128, dtype=torch.int64)
    dyn = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
           "logits": {0: "batch"}, "hidden": {0: "batch", 1: "seq"}}
    with torch.no_grad():
        export(bert, (ids, mask), ["input_ids", "attention_mask"], ["logits", "hidden"], dyn, path)
    print(f"bert_base: {os.path.getsize(path) / 1e6:.1f} MB")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--full":
        full_size(sys.argv[2])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "models/onnx")
