"""Built-in models for tests, benchmarks and the ``smp`` CLI.

Every model is built from a config with random weights (nothing is downloaded), all dropout
probabilities are 0 so repeated runs are bit-for-bit deterministic, and each one comes with an
example microbatch, a matching target and a loss function. With the default batch of 4 on one
CPU thread, forward+backward takes about 5-20 ms at ``size="small"`` and 20-150 ms at
``size="base"`` (more and wider blocks, for benchmarks). Input shapes do not depend on ``size``,
so :func:`make_batch` needs only the name.

Each model exports with ``torch.export.export(model, args, kwargs, strict=False)`` (the way the
engine traces) and the exported module reproduces the eager output.

The models cover the structures a partitioner has to get right: tied input/output embeddings
(gpt2), padding masks passed as keyword tensors (bert), encoder output read by every decoder
layer (t5), long skip connections and BatchNorm buffers (unet), parallel branches with a shared
conv (inception).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ZooModel", "Batch", "NAMES", "SIZES", "build", "make_batch", "MLP", "UNet", "Inception"]

SIZES: tuple[str, ...] = ("small", "base")

# Input shapes shared by all sizes.
_VOCAB = 512
_SEQ = 32
_DECODER_SEQ = 16
_IMAGE = 32
_CHANNELS = 3
_CLASSES = 4
_MLP_FEATURES = 64

Batch = tuple[tuple, dict, torch.Tensor]  # (args, kwargs, target)


@dataclass
class ZooModel:
    """A model with one example microbatch, its target and a loss."""

    name: str
    model: nn.Module
    args: tuple
    kwargs: dict
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]  # (model output, target) -> scalar mean loss
    target: torch.Tensor
    blocks: str  # dotted path of the ModuleList / Sequential of repeated blocks

    def loss(self) -> torch.Tensor:
        """Loss of the model on the example batch."""
        return self.loss_fn(self.model(*self.args, **self.kwargs), self.target)


@dataclass(frozen=True)
class _Transformer:
    layers: int
    hidden: int
    heads: int


_TRANSFORMER = {"small": _Transformer(4, 128, 4), "base": _Transformer(12, 256, 8)}


def _logits_cross_entropy(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of a HuggingFace output's class-last ``.logits`` against integer targets."""
    return F.cross_entropy(output.logits.movedim(-1, 1), target)


# HuggingFace models. attn_implementation="eager" spells attention out as matmul/softmax nodes the
# partitioner can cost individually; "sdpa" exports too but becomes one opaque node.


def _gpt2(size: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    d = _TRANSFORMER[size]
    config = GPT2Config(
        vocab_size=_VOCAB, n_positions=_SEQ, n_embd=d.hidden, n_layer=d.layers, n_head=d.heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
        bos_token_id=0, eos_token_id=0,  # the defaults (50256) lie outside the small vocabulary
        tie_word_embeddings=True, attn_implementation="eager",
    )
    return GPT2LMHeadModel(config)


def _bert(size: str) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    d = _TRANSFORMER[size]
    config = BertConfig(
        vocab_size=_VOCAB, hidden_size=d.hidden, num_hidden_layers=d.layers, num_attention_heads=d.heads,
        intermediate_size=4 * d.hidden, max_position_embeddings=_SEQ, num_labels=_CLASSES,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0,
        attn_implementation="eager",
    )
    return BertForSequenceClassification(config)


def _vit(size: str) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    d = _TRANSFORMER[size]
    config = ViTConfig(
        image_size=_IMAGE, patch_size=8, num_channels=_CHANNELS, hidden_size=d.hidden,
        num_hidden_layers=d.layers, num_attention_heads=d.heads, intermediate_size=4 * d.hidden,
        num_labels=_CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    return ViTForImageClassification(config)


def _resnet(size: str) -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    depths = {"small": [1, 1, 1, 1], "base": [2, 3, 3, 2]}[size]
    widths = {"small": [32, 64, 128, 256], "base": [64, 128, 256, 512]}[size]
    config = ResNetConfig(
        num_channels=_CHANNELS, embedding_size=widths[0], hidden_sizes=widths, depths=depths,
        layer_type="basic", num_labels=_CLASSES,
    )
    return ResNetForImageClassification(config)


def _t5(size: str) -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    d = _TRANSFORMER[size]
    config = T5Config(
        vocab_size=_VOCAB, d_model=d.hidden, d_kv=d.hidden // d.heads, d_ff=2 * d.hidden,
        num_layers=d.layers, num_decoder_layers=d.layers, num_heads=d.heads, dropout_rate=0.0,
        classifier_dropout=0.0, pad_token_id=0, eos_token_id=1, attn_implementation="eager",
    )
    return T5ForConditionalGeneration(config)


# Plain torch models.


class MLP(nn.Module):
    """Input projection, ``depth`` Linear+GELU blocks in ``layers``, classifier head."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Linear(_MLP_FEATURES, width)
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)))
        self.head = nn.Linear(width, _CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits of a batch of feature vectors."""
        return self.head(self.layers(self.embed(x)))


def _conv_bn_relu(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class _UpBlock(nn.Module):
    """Upsample 2x, concatenate the matching down-path output, convolve."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cout, 2, stride=2)
        self.conv = _conv_bn_relu(2 * cout, cout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    """Segmentation UNet; ``blocks`` holds the down path, the bottleneck and the up path in
    execution order, so every down block's output crosses the rest of the network to its up block."""

    def __init__(self, width: int, levels: int) -> None:
        super().__init__()
        chans = [width * 2**i for i in range(levels + 1)]
        down = [_conv_bn_relu(_CHANNELS if i == 0 else chans[i - 1], chans[i]) for i in range(levels)]
        bottleneck = _conv_bn_relu(chans[levels - 1], chans[levels])
        up = [_UpBlock(chans[i + 1], chans[i]) for i in reversed(range(levels))]
        self.levels = levels
        self.blocks = nn.ModuleList([*down, bottleneck, *up])
        self.head = nn.Conv2d(chans[0], _CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Per-pixel class logits of a batch of images (encoder, bottleneck, decoder with skips)."""
        skips = []
        for down in self.blocks[: self.levels]:
            x = down(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.blocks[self.levels](x)
        for up in self.blocks[self.levels + 1 :]:
            x = up(x, skips.pop())
        return self.head(x)


class _InceptionBlock(nn.Module):
    """Four parallel branches concatenated on channels; ``shared`` is used by two of them."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        b = channels // 4
        self.branch1 = nn.Conv2d(channels, b, 1)
        self.reduce3 = nn.Conv2d(channels, b, 1)
        self.reduce5 = nn.Conv2d(channels, b, 1)
        self.shared = nn.Conv2d(b, b, 3, padding=1)
        self.extra5 = nn.Conv2d(b, b, 3, padding=1)  # two stacked 3x3 convs see a 5x5 window
        self.pool_proj = nn.Conv2d(channels, b, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.relu(self.branch1(x))
        b = F.relu(self.shared(F.relu(self.reduce3(x))))
        c = F.relu(self.extra5(F.relu(self.shared(F.relu(self.reduce5(x))))))
        d = F.relu(self.pool_proj(F.max_pool2d(x, 3, stride=1, padding=1)))
        return torch.cat([a, b, c, d], dim=1)


class Inception(nn.Module):
    """Strided stem, ``depth`` inception blocks in ``blocks``, pooled classifier head."""

    def __init__(self, channels: int, depth: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(_CHANNELS, channels, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList(_InceptionBlock(channels) for _ in range(depth))
        self.head = nn.Linear(channels, _CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits of a batch of images."""
        x = F.relu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def _mlp(size: str) -> nn.Module:
    return MLP(*{"small": (1024, 4), "base": (1024, 12)}[size])


def _unet(size: str) -> nn.Module:
    return UNet(*{"small": (16, 3), "base": (32, 4)}[size])


def _inception(size: str) -> nn.Module:
    return Inception(*{"small": (64, 4), "base": (96, 12)}[size])


# Example batches.


def _tokens(batch: int, g: torch.Generator) -> Batch:
    ids = torch.randint(_VOCAB, (batch, _SEQ), generator=g)
    return (ids,), {"use_cache": False}, torch.roll(ids, -1, dims=1)  # next-token targets


def _padded_tokens(batch: int, g: torch.Generator) -> Batch:
    ids = torch.randint(_VOCAB, (batch, _SEQ), generator=g)
    lengths = torch.randint(_SEQ // 2, _SEQ + 1, (batch, 1), generator=g)
    mask = (torch.arange(_SEQ) < lengths).long()
    return (ids,), {"attention_mask": mask}, torch.randint(_CLASSES, (batch,), generator=g)


def _seq2seq(batch: int, g: torch.Generator) -> Batch:
    ids = torch.randint(_VOCAB, (batch, _SEQ), generator=g)
    decoder_ids = torch.randint(_VOCAB, (batch, _DECODER_SEQ), generator=g)
    kwargs = {"decoder_input_ids": decoder_ids, "use_cache": False}
    return (ids,), kwargs, torch.roll(decoder_ids, -1, dims=1)


def _images(batch: int, g: torch.Generator) -> Batch:
    images = torch.randn(batch, _CHANNELS, _IMAGE, _IMAGE, generator=g)
    return (images,), {}, torch.randint(_CLASSES, (batch,), generator=g)


def _segmentation(batch: int, g: torch.Generator) -> Batch:
    images = torch.randn(batch, _CHANNELS, _IMAGE, _IMAGE, generator=g)
    return (images,), {}, torch.randint(_CLASSES, (batch, _IMAGE, _IMAGE), generator=g)


def _features(batch: int, g: torch.Generator) -> Batch:
    x = torch.randn(batch, _MLP_FEATURES, generator=g)
    return (x,), {}, torch.randint(_CLASSES, (batch,), generator=g)


@dataclass(frozen=True)
class _Spec:
    make_model: Callable[[str], nn.Module]
    make_batch: Callable[[int, torch.Generator], Batch]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    blocks: str


_SPECS: dict[str, _Spec] = {
    "gpt2": _Spec(_gpt2, _tokens, _logits_cross_entropy, "transformer.h"),
    "bert": _Spec(_bert, _padded_tokens, _logits_cross_entropy, "bert.encoder.layer"),
    "vit": _Spec(_vit, _images, _logits_cross_entropy, "vit.layers"),
    "resnet": _Spec(_resnet, _images, _logits_cross_entropy, "resnet.encoder.stages"),
    # The decoder blocks each read the encoder output: the interesting cut for pipelining.
    "t5": _Spec(_t5, _seq2seq, _logits_cross_entropy, "decoder.block"),
    "mlp": _Spec(_mlp, _features, F.cross_entropy, "layers"),
    "unet": _Spec(_unet, _segmentation, F.cross_entropy, "blocks"),
    "inception": _Spec(_inception, _images, F.cross_entropy, "blocks"),
}
NAMES: tuple[str, ...] = tuple(_SPECS)


def _spec(name: str) -> _Spec:
    if name not in _SPECS:
        raise ValueError(f"unknown zoo model {name!r}; choose one of {', '.join(NAMES)}")
    return _SPECS[name]


def make_batch(name: str, batch: int = 4, seed: int = 0) -> Batch:
    """A random ``(args, kwargs, target)`` batch for model ``name``; the same shapes as the example
    batch of :func:`build` (which uses ``make_batch(name, batch, seed)``)."""
    spec = _spec(name)
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return spec.make_batch(batch, torch.Generator().manual_seed(seed))


def build(name: str, *, batch: int = 4, size: str = "small", seed: int = 0) -> ZooModel:
    """Build zoo model ``name`` in train mode with weights drawn after ``torch.manual_seed(seed)``
    and the example batch ``make_batch(name, batch, seed)``; unknown names or sizes raise ValueError."""
    spec = _spec(name)
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} for zoo model {name!r}; choose one of {', '.join(SIZES)}")
    args, kwargs, target = make_batch(name, batch, seed)
    torch.manual_seed(seed)
    model = spec.make_model(size)
    model.train()
    return ZooModel(name, model, args, kwargs, spec.loss_fn, target, spec.blocks)
