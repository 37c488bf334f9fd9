"""Builds the ONNX corpus Kiln's importer is measured on: models as users export them.

Three sources, each at a tiny configuration where the architecture allows, random weights,
nothing downloaded:
  * `nn`: plain `torch.nn` code of the kinds users write and that the image families in
    `tools/export_onnx_models.py` do not cover: recurrent models (LSTM, GRU, RNN, both
    directions, initial states), audio (1-D convolutions, GroupNorm, a Whisper-style stem),
    video (3-D convolutions and pooling), image-to-image (InstanceNorm U-Net, style
    transfer, GroupNorm + SiLU diffusion block, PixelShuffle), decoders (a causal mask by
    `torch.triu`, `scaled_dot_product_attention(is_causal=True)`), window attention (in-place
    slice assignment), Einsum attention, `nn.TransformerEncoder`, and the indexing operators
    (gather/scatter, top-k, cumulative sum, one-hot, tile, nonzero).
  * `timm`: vision architectures from `timm.create_model(..., pretrained=False)` (`--set full`).
  * `transformers`: GPT-2, BERT, T5-encoder, ViT, Swin, wav2vec2, Whisper-encoder and a
    Llama-style decoder (RoPE, RMSNorm) built from small configs (`--set full`).

Each model is exported by `torch.onnx.export` (TorchScript exporter at opset 17, and for
`nn` models also the `dynamo=True` exporter, named `NAME.dynamo`), with a dynamic batch axis.
For each the script writes `NAME.onnx` and `NAME.ref.safetensors` (seeded inputs at batch 1
and 3 and ONNX Runtime's outputs, named as in export_onnx_models.py), and `corpus.json`
lists every model with its family and the operators it holds. A model that torch cannot
export, or that ONNX Runtime cannot run, is listed with the reason and skipped: the corpus
measures Kiln, not the exporter.

    python tools/onnx_corpus.py models/onnx/corpus            # the committed `nn` set
    python tools/onnx_corpus.py --set full /tmp/onnx-corpus   # + timm and transformers

`crates/kiln/tests/onnx_corpus.rs` checks every model of the committed set, or of the
directory `KILN_ONNX_CORPUS` names, against its reference outputs.
"""

import argparse
import collections
import json
import os
import sys
import traceback

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from export_onnx_models import reference, save_safetensors  # noqa: E402


# --- plain torch.nn models --------------------------------------------------------------


class LstmClassifier(nn.Module):
    """Embedding, a 2-layer bidirectional LSTM (batch-first), the last step's features."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.lstm = nn.LSTM(16, 24, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(48, 5)

    def forward(self, tokens):
        y, _ = self.lstm(self.embed(tokens))
        return self.head(y[:, -1])


class GruTagger(nn.Module):
    """A GRU given its initial state as an input (a streaming model's carried state), and
    returning the final state as a second output."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(12, 20, batch_first=True)
        self.head = nn.Linear(20, 4)

    def forward(self, x, h0):
        y, h = self.gru(x, h0)
        return self.head(y), h


class RnnTanh(nn.Module):
    """An Elman RNN (tanh), bidirectional, sequence-first as nn.RNN defaults to."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(10, 16, bidirectional=True)
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y.mean(0))


class Wav2VecEncoder(nn.Module):
    """wav2vec 2.0's feature encoder at small width: strided 1-D convolutions on the raw
    waveform, GroupNorm (one group per channel) after the first, GELU, then LayerNorm and a
    projection over the frames."""

    def __init__(self, width=32):
        super().__init__()
        layers = [(10, 5), (3, 2), (3, 2), (2, 2)]
        convs, cin = [], 1
        for k, s in layers:
            convs.append(nn.Conv1d(cin, width, k, stride=s, bias=False))
            cin = width
        self.convs = nn.ModuleList(convs)
        self.norm0 = nn.GroupNorm(width, width)
        self.ln = nn.LayerNorm(width)
        self.proj = nn.Linear(width, 16)

    def forward(self, wave):
        x = wave.unsqueeze(1)
        for i, conv in enumerate(self.convs):
            x = conv(x)
            if i == 0:
                x = self.norm0(x)
            x = F.gelu(x)
        return self.proj(self.ln(x.transpose(1, 2)))


class Tcn(nn.Module):
    """A temporal convolution network: dilated causal 1-D convolutions (left padding by
    Pad), residual 1×1 convolutions, ReLU, and a 1-D max and average pool."""

    def __init__(self, cin=6, width=16):
        super().__init__()
        self.blocks = nn.ModuleList()
        for i, d in enumerate((1, 2, 4)):
            self.blocks.append(
                nn.ModuleDict(
                    dict(
                        conv=nn.Conv1d(cin if i == 0 else width, width, 3, dilation=d),
                        res=nn.Conv1d(cin if i == 0 else width, width, 1),
                    )
                )
            )
        self.pool = nn.MaxPool1d(2)
        self.avg = nn.AvgPool1d(3, stride=2, padding=1)
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            d = (1, 2, 4)[i]
            x = F.relu(b["conv"](F.pad(x, (2 * d, 0)))) + b["res"](x)
        x = self.avg(self.pool(x))
        return self.head(x.mean(-1))


class WhisperStem(nn.Module):
    """Whisper's audio encoder at small width: two 1-D convolutions (the second stride 2)
    with GELU over a log-mel spectrogram, sinusoidal positions, a pre-LN
    nn.TransformerEncoderLayer."""

    def __init__(self, mels=16, d=32):
        super().__init__()
        self.c1 = nn.Conv1d(mels, d, 3, padding=1)
        self.c2 = nn.Conv1d(d, d, 3, stride=2, padding=1)
        self.register_buffer("pos", torch.sin(torch.arange(64)[:, None] * torch.arange(d)[None] * 0.01))
        self.block = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True, norm_first=True,
                                                activation="gelu")
        self.ln = nn.LayerNorm(d)

    def forward(self, mel):
        x = F.gelu(self.c2(F.gelu(self.c1(mel)))).transpose(1, 2)
        x = x + self.pos[: x.shape[1]]
        return self.ln(self.block(x))


class Video3d(nn.Module):
    """A C3D-style clip classifier: 3-D convolutions with BatchNorm3d and ReLU, 3-D max and
    average pooling, adaptive average pooling to one value per channel."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Sequential(nn.Conv3d(3, 8, 3, padding=1), nn.BatchNorm3d(8), nn.ReLU())
        self.p1 = nn.MaxPool3d((1, 2, 2))
        self.c2 = nn.Sequential(nn.Conv3d(8, 16, (3, 3, 3), stride=(1, 2, 2), padding=1), nn.ReLU())
        self.p2 = nn.AvgPool3d(2)
        self.head = nn.Linear(16, 5)

    def forward(self, clip):
        x = self.p2(self.c2(self.p1(self.c1(clip))))
        return self.head(F.adaptive_avg_pool3d(x, 1).flatten(1))


class R2Plus1d(nn.Module):
    """A (2+1)-D block as torchvision's R(2+1)D writes it: a 1×3×3 spatial convolution then a
    3×1×1 temporal one, a 3-D transposed convolution upsampling in time."""

    def __init__(self):
        super().__init__()
        self.spatial = nn.Conv3d(3, 8, (1, 3, 3), padding=(0, 1, 1))
        self.temporal = nn.Conv3d(8, 8, (3, 1, 1), padding=(1, 0, 0))
        self.up = nn.ConvTranspose3d(8, 4, (2, 1, 1), stride=(2, 1, 1))

    def forward(self, clip):
        return self.up(F.relu(self.temporal(F.relu(self.spatial(clip)))))


class InstanceUNet(nn.Module):
    """A two-level U-Net with InstanceNorm2d (affine) and LeakyReLU, transposed-convolution
    upsampling and skip concatenation: the image-to-image generator shape (pix2pix)."""

    def __init__(self, c=8):
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.InstanceNorm2d(cout, affine=True),
                                 nn.LeakyReLU(0.2))

        self.e1, self.e2, self.mid = block(3, c), block(c, 2 * c), block(2 * c, 2 * c)
        self.u2 = nn.ConvTranspose2d(2 * c, 2 * c, 2, stride=2)
        self.d2 = block(4 * c, c)
        self.u1 = nn.ConvTranspose2d(c, c, 2, stride=2)
        self.d1 = block(2 * c, c)
        self.out = nn.Conv2d(c, 3, 1)

    def forward(self, x):
        s1 = self.e1(x)
        s2 = self.e2(F.max_pool2d(s1, 2))
        m = self.mid(F.max_pool2d(s2, 2))
        y = self.d2(torch.cat([self.u2(m), s2], 1))
        y = self.d1(torch.cat([self.u1(y), s1], 1))
        return torch.tanh(self.out(y))


class StyleTransfer(nn.Module):
    """Johnson et al.'s style-transfer net, small: reflection padding, InstanceNorm without
    affine terms, residual blocks, nearest upsampling."""

    def __init__(self, c=8):
        super().__init__()
        self.inp = nn.Conv2d(3, c, 5)
        self.n0 = nn.InstanceNorm2d(c)
        self.down = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.n1 = nn.InstanceNorm2d(2 * c)
        self.res = nn.ModuleList(nn.Conv2d(2 * c, 2 * c, 3) for _ in range(2))
        self.rn = nn.ModuleList(nn.InstanceNorm2d(2 * c, affine=True) for _ in range(2))
        self.upc = nn.Conv2d(2 * c, c, 3, padding=1)
        self.out = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x):
        y = F.relu(self.n0(self.inp(F.pad(x, (2, 2, 2, 2), mode="reflect"))))
        y = F.relu(self.n1(self.down(y)))
        for conv, norm in zip(self.res, self.rn):
            y = y + norm(conv(F.pad(y, (1, 1, 1, 1), mode="reflect")))
        y = F.relu(self.upc(F.interpolate(y, scale_factor=2, mode="nearest")))
        return self.out(y)


class DiffusionBlock(nn.Module):
    """A diffusion U-Net's residual block: GroupNorm(4 groups) + SiLU + 3×3 convolution, a
    timestep embedding (sinusoidal, from an int input) added per channel, PixelShuffle up."""

    def __init__(self, c=16):
        super().__init__()
        self.inp = nn.Conv2d(3, c, 3, padding=1)
        self.n1, self.c1 = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)
        self.n2, self.c2 = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)
        self.temb = nn.Linear(16, c)
        self.shuffle = nn.Sequential(nn.Conv2d(c, 12, 3, padding=1), nn.PixelShuffle(2))

    def forward(self, x, t):
        freqs = torch.exp(-torch.arange(8, dtype=torch.float32) * 0.5)
        args = t.float()[:, None] * freqs[None]
        emb = self.temb(torch.cat([torch.sin(args), torch.cos(args)], 1))
        h = self.inp(x)
        y = self.c1(F.silu(self.n1(h))) + emb[:, :, None, None]
        y = self.c2(F.silu(self.n2(y))) + h
        return self.shuffle(y)


class CausalLm(nn.Module):
    """A GPT-style decoder: token and learned position embeddings, pre-LN blocks whose causal
    mask is `torch.triu` of a run-time sized matrix, tied output projection."""

    def __init__(self, vocab=64, d=32, heads=4, layers=2):
        super().__init__()
        self.heads = heads
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(32, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(dict(ln1=nn.LayerNorm(d), qkv=nn.Linear(d, 3 * d), o=nn.Linear(d, d),
                               ln2=nn.LayerNorm(d), up=nn.Linear(d, 4 * d), down=nn.Linear(4 * d, d)))
            for _ in range(layers)
        )
        self.ln = nn.LayerNorm(d)

    def forward(self, ids):
        b, t = ids.shape
        x = self.tok(ids) + self.pos(torch.arange(t))
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).chunk(3, -1)
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5) + mask).softmax(-1)
            x = x + blk["o"]((att @ v).transpose(1, 2).reshape(b, t, -1))
            x = x + blk["down"](F.gelu(blk["up"](blk["ln2"](x)), approximate="tanh"))
        return self.ln(x) @ self.tok.weight.t()


class SdpaDecoder(nn.Module):
    """`F.scaled_dot_product_attention(is_causal=True)` (its export builds the mask with
    Trilu), RMSNorm written out, SwiGLU: the Llama-style block as user code writes it."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.gate, self.up = nn.Linear(d, 64, bias=False), nn.Linear(d, 64, bias=False)
        self.down = nn.Linear(64, d, bias=False)
        self.w1, self.w2 = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))

    def rms(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.rms(x, self.w1)).chunk(3, -1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, -1))
        h = self.rms(x, self.w2)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TorchEncoder(nn.Module):
    """`nn.TransformerEncoder` itself, post-LN (the default) over a projected input, with a
    key padding mask from a second input."""

    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(8, d)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        return self.head(self.enc(self.inp(x)).mean(1))


class WindowAttention(nn.Module):
    """Swin-style: the feature map partitioned into windows by reshape/permute, attention
    inside each window with a relative-position bias gathered from a table, a cyclic shift
    (torch.roll), and a class-token slot written in place (slice assignment: ScatterND)."""

    def __init__(self, c=16, win=4, heads=2):
        super().__init__()
        self.win, self.heads = win, heads
        self.embed = nn.Conv2d(3, c, 2, stride=2)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.table = nn.Parameter(torch.randn((2 * win - 1) ** 2, heads) * 0.1)
        coords = torch.stack(torch.meshgrid(torch.arange(win), torch.arange(win), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + win - 1
        self.register_buffer("index", rel[..., 0] * (2 * win - 1) + rel[..., 1])
        self.head = nn.Linear(c, 4)

    def forward(self, x):
        x = self.embed(x).permute(0, 2, 3, 1)  # B H W C
        b, h, w, c = x.shape
        x = torch.roll(x, shifts=(-2, -2), dims=(1, 2))
        n = self.win
        win = x.view(b, h // n, n, w // n, n, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, n * n, c)
        q, k, v = self.qkv(win).view(win.shape[0], n * n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        bias = self.table[self.index.view(-1)].view(n * n, n * n, -1).permute(2, 0, 1)
        att = (q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5) + bias).softmax(-1)
        y = self.proj((att @ v).transpose(1, 2).reshape(-1, n * n, c))
        y = y.view(b, -1, c)
        y[:, 0] = y.mean(1)  # a summary token written in place
        return self.head(y[:, 0])


class EinsumMixer(nn.Module):
    """Attention and channel mixing written with torch.einsum (as mixed-attention and
    MLP-Mixer-style code does)."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.mix = nn.Parameter(torch.randn(d, d) * 0.2)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).unbind(2)
        att = torch.einsum("bihd,bjhd->bhij", q, k).softmax(-1)
        y = torch.einsum("bhij,bjhd->bihd", att, v).reshape(b, t, d)
        y = torch.einsum("btd,de->bte", y, self.mix)
        return self.head(y.sum(1))


class Indexing(nn.Module):
    """The indexing operators user code reaches for: torch.gather (GatherElements),
    scatter (ScatterElements), topk, cumsum, one_hot, repeat (Tile), advanced indexing
    (GatherND), nonzero, PReLU, ELU, SELU, Mish and Softsign."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.prelu = nn.PReLU(8)

    def forward(self, x, idx):
        y = self.prelu(self.lin(x))  # B 8
        g = torch.gather(y, 1, idx)  # B 3
        s = torch.zeros_like(y).scatter(1, idx, g)
        top, where = torch.topk(y, 3, dim=1)
        c = torch.cumsum(F.elu(y), dim=1) + F.selu(s) + F.mish(y) + F.softsign(y)
        hot = F.one_hot(where[:, 0], 8).float()
        t = (c + hot).repeat(1, 2)
        rows = torch.arange(x.shape[0])
        picked = t[rows, where[:, 1]]
        nz = torch.nonzero(y > 0).shape[0]
        return t, top, picked + nz


def nn_models():
    """(name, model, inputs: list of (name, shape without batch, kind), outputs, extra
    dynamic axes per input)."""
    return [
        ("lstm", LstmClassifier(), [("tokens", (12,), "tokens:50")], ["logits"], {"tokens": {1: "seq"}}),
        ("gru", GruTagger(), [("x", (9, 12), "float"), ("h0", None, "state:1x20")], ["tags", "h"], {}),
        ("rnn", RnnTanh(), [("x", (7, None, 10), "seqfirst")], ["logits"], {}),
        ("wav2vec_encoder", Wav2VecEncoder(), [("wave", (400,), "float")], ["features"], {}),
        ("tcn", Tcn(), [("x", (6, 40), "float")], ["logits"], {}),
        ("whisper_stem", WhisperStem(), [("mel", (16, 40), "float")], ["hidden"], {}),
        ("video3d", Video3d(), [("clip", (3, 4, 16, 16), "float")], ["logits"], {}),
        ("r2plus1d", R2Plus1d(), [("clip", (3, 4, 8, 8), "float")], ["out"], {}),
        ("instance_unet", InstanceUNet(), [("image", (3, 16, 16), "float")], ["out"], {}),
        ("style_transfer", StyleTransfer(), [("image", (3, 16, 16), "float")], ["out"], {}),
        ("diffusion_block", DiffusionBlock(), [("x", (3, 8, 8), "float"), ("t", (), "tokens:1000")], ["out"], {}),
        ("causal_lm", CausalLm(), [("ids", (10,), "tokens:64")], ["logits"], {"ids": {1: "seq"}}),
        ("sdpa_decoder", SdpaDecoder(), [("x", (10, 32), "float")], ["out"], {}),
        ("torch_encoder", TorchEncoder(), [("x", (10, 8), "float")], ["logits"], {}),
        ("window_attention", WindowAttention(), [("image", (3, 16, 16), "float")], ["logits"], {}),
        ("einsum_mixer", EinsumMixer(), [("x", (6, 16), "float")], ["logits"], {}),
        ("indexing", Indexing(), [("x", (8,), "float"), ("idx", (3,), "tokens:8")], ["t", "top", "picked"], {}),
    ]


# --- timm and transformers (the full set) -------------------------------------------------

TIMM = [
    "resnet18", "resnet50d", "resnext26ts", "seresnext26d_32x4d", "regnetx_002", "regnety_002",
    "mobilenetv2_050", "mobilenetv3_small_050", "mobilenetv4_conv_small", "efficientnet_b0",
    "efficientnet_lite0", "mnasnet_050", "fbnetc_100", "ghostnet_050", "lcnet_050", "mixnet_s",
    "tinynet_e", "hardcorenas_a", "dla34", "dpn48b", "densenet121", "vgg11_bn", "repvgg_a0",
    "rexnet_100", "cspresnet50", "cspdarknet53", "darknet17", "hrnet_w18_small", "res2net50_14w_8s",
    "resnest14d", "sknet18" if False else "skresnet18", "selecsls42b", "tresnet_m" if False else "xception41",
    "inception_v3", "convnext_atto", "convnextv2_atto", "edgenext_xx_small", "mobilevit_xxs",
    "mobilevitv2_050", "efficientformer_l1", "efficientvit_b0", "fastvit_t8", "levit_128s",
    "poolformer_s12", "convmixer_768_32" if False else "convmixer_1024_20_ks9_p14", "mixer_s16_224",
    "resmlp_12_224", "gmlp_ti16_224", "vit_tiny_patch16_224", "deit_tiny_patch16_224",
    "cait_xxs24_224", "xcit_nano_12_p16_224", "pit_ti_224", "coat_lite_tiny", "twins_svt_small",
    "swin_tiny_patch4_window7_224", "swinv2_cr_tiny_224", "maxvit_nano_rw_256", "coatnet_nano_rw_224",
    "crossvit_tiny_240", "tnt_s_patch16_224", "nfnet_l0", "regnetz_b16", "ese_vovnet19b_dw", "hgnetv2_b0",
]


def transformers_models():
    import transformers as tr

    def lm(config_cls, model_cls, **kw):
        return model_cls(config_cls(**kw))

    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    return [
        ("hf_gpt2", lm(tr.GPT2Config, tr.GPT2LMHeadModel, n_embd=32, n_layer=2, n_head=4, vocab_size=100,
                       n_positions=64), "ids"),
        ("hf_bert", lm(tr.BertConfig, tr.BertModel, vocab_size=100, **small), "ids"),
        ("hf_t5_encoder", lm(tr.T5Config, tr.T5EncoderModel, vocab_size=100, d_model=32, d_kv=8, d_ff=64,
                             num_layers=2, num_heads=4), "ids"),
        ("hf_llama", lm(tr.LlamaConfig, tr.LlamaForCausalLM, vocab_size=100, num_key_value_heads=2, **small),
         "ids"),
        ("hf_vit", lm(tr.ViTConfig, tr.ViTModel, image_size=32, patch_size=8, **small), "pixels:3x32x32"),
        ("hf_swin", lm(tr.SwinConfig, tr.SwinModel, image_size=32, patch_size=2, embed_dim=16, depths=[1, 1],
                       num_heads=[2, 2], window_size=4), "pixels:3x32x32"),
        ("hf_wav2vec2", lm(tr.Wav2Vec2Config, tr.Wav2Vec2Model, conv_dim=(16, 16), conv_kernel=(10, 3),
                           conv_stride=(5, 2), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
                           **small), "wave:400"),
        ("hf_whisper_encoder", tr.WhisperModel(tr.WhisperConfig(d_model=32, encoder_layers=2, decoder_layers=1,
                                                                encoder_attention_heads=4,
                                                                decoder_attention_heads=4,
                                                                encoder_ffn_dim=64, decoder_ffn_dim=64,
                                                                num_mel_bins=16,
                                                                max_source_positions=20)).encoder,
         "mel:16x40"),
    ]


# --- export -------------------------------------------------------------------------------


def make_input(kind, shape, batch, rng, torch_gen):
    if kind.startswith("tokens:"):
        high = int(kind.split(":")[1])
        return rng.integers(0, high, (batch, *shape), dtype=np.int64)
    if kind.startswith("state:"):
        layers, hidden = map(int, kind.split(":")[1].split("x"))
        return rng.standard_normal((layers, batch, hidden), dtype=np.float32)
    if kind == "seqfirst":
        t, _, f = shape
        return rng.standard_normal((t, batch, f), dtype=np.float32)
    return rng.standard_normal((batch, *shape), dtype=np.float32)


def batch_axis(kind):
    return 1 if kind in ("seqfirst",) or kind.startswith("state:") else 0


def op_counts(path):
    import onnx

    counts = collections.Counter()

    def walk(graph):
        for n in graph.node:
            counts[n.op_type] += 1
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)

    walk(onnx.load(path, load_external_data=False).graph)
    return dict(sorted(counts.items()))


def randomize(model, gen):
    """Weights that make every layer matter: zero parameters (biases, heads) get small random
    values; normalization statistics are calibrated by one train-mode pass elsewhere."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def export_one(out_dir, name, model, inputs, outputs, extra_dynamic, dynamo, rng, gen):
    model.eval()
    randomize(model, gen)
    example = tuple(torch.from_numpy(make_input(k, s, 2, rng, gen)) for _, s, k in inputs)
    names = [n for n, _, _ in inputs]
    path = os.path.join(out_dir, f"{name}.onnx")
    with torch.no_grad():
        if dynamo:
            batch = torch.export.Dim("batch", min=1, max=64)
            shapes = tuple({batch_axis(k): batch} for _, _, k in inputs)
            torch.onnx.export(model, example, path, input_names=names, output_names=outputs,
                              dynamic_shapes=shapes, dynamo=True, opset_version=18, external_data=False)
        else:
            dynamic = {}
            for n, _, k in inputs:
                dynamic[n] = {batch_axis(k): "batch", **extra_dynamic.get(n, {})}
            torch.onnx.export(model, example, path, input_names=names, output_names=outputs,
                              dynamic_axes=dynamic, opset_version=17, dynamo=False)
    feeds = {b: {n: make_input(k, s, b, rng, gen) for n, s, k in inputs} for b in (1, 3)}
    tensors = reference(path, feeds)
    save_safetensors(os.path.join(out_dir, f"{name}.ref.safetensors"), tensors)
    return path


def hf_inputs(kind):
    if kind == "ids":
        return [("input_ids", (12,), "tokens:100")]
    what, dims = kind.split(":")
    return [({"pixels": "pixel_values", "wave": "input_values", "mel": "input_features"}[what],
             tuple(int(d) for d in dims.split("x")), "float")]


class FirstOutput(nn.Module):
    """A transformers model returning its first output tensor (logits or hidden states)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        out = self.model(x, return_dict=False) if "return_dict" in self.model.forward.__code__.co_varnames else self.model(x)
        return out[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--set", choices=["nn", "full"], default="nn")
    ap.add_argument("--only", default="", help="comma-separated model names")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    only = set(filter(None, args.only.split(",")))
    torch.backends.mha.set_fastpath_enabled(False)

    jobs = []
    for name, model, inputs, outputs, extra in nn_models():
        jobs.append((name, "nn", model, inputs, outputs, extra, False))
        jobs.append((f"{name}.dynamo", "nn", model, inputs, outputs, extra, True))
    if args.set == "full":
        import timm

        for arch in TIMM:
            try:
                model = timm.create_model(arch, pretrained=False, num_classes=10)
            except Exception as e:  # noqa: BLE001 - an architecture this timm lacks
                print(f"timm {arch}: {e}", file=sys.stderr)
                continue
            size = model.pretrained_cfg.get("input_size", (3, 224, 224))
            jobs.append((f"timm_{arch}", "timm", model, [("input", tuple(size), "float")], ["logits"], {}, False))
        for name, model, kind in transformers_models():
            jobs.append((name, "transformers", FirstOutput(model), hf_inputs(kind), ["out"],
                         {"input_ids": {1: "seq"}}, False))

    listing = []
    for name, family, model, inputs, outputs, extra, dynamo in jobs:
        if only and name not in only and name.split(".")[0] not in only:
            continue
        entry = {"name": name, "family": family, "exporter": "dynamo" if dynamo else "torchscript"}
        try:
            path = export_one(args.out, name, model, inputs, outputs, extra, dynamo, rng, gen)
            entry["ops"] = op_counts(path)
            entry["mb"] = round(os.path.getsize(path) / 1e6, 3)
            print(f"{name}: {entry['mb']} MB, {sum(entry['ops'].values())} nodes")
        except Exception as e:  # noqa: BLE001 - listed, not fatal: the exporter's limits
            entry["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            print(f"{name}: skipped ({entry['skipped']})", file=sys.stderr)
            if os.environ.get("CORPUS_TRACE"):
                traceback.print_exc()
            for suffix in (".onnx", ".ref.safetensors"):
                p = os.path.join(args.out, name + suffix)
                if os.path.exists(p):
                    os.remove(p)
        listing.append(entry)
    index = os.path.join(args.out, "corpus.json")
    old = []
    if only and os.path.exists(index):
        old = [e for e in json.load(open(index)) if e["name"] not in {x["name"] for x in listing}]
    with open(index + ".tmp", "w") as f:
        json.dump(sorted(old + listing, key=lambda e: e["name"]), f, indent=1)
    os.replace(index + ".tmp", index)


if __name__ == "__main__":
    main()
