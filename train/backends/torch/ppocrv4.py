"""The PP-OCRv4 mobile recognizer in PyTorch (train/backends/common.py's PPOCRV4_* plan).

[N, 3, 48, W] images normalized to [-1, 1] (BGR) -> [N, W/8, num_classes] logits; the released
model's softmax of these is what its ONNX export outputs. Submodules are registered in the
order the export computes them: train/ppocrv4_weights.py maps the released tensors by that
order, so reordering them here breaks the conversion (the fidelity tests say so).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from train.backends.common import (
    PPOCRV4_BLOCK_EPS,
    PPOCRV4_BLOCKS,
    PPOCRV4_BN_EPS,
    PPOCRV4_FINAL_EPS,
    PPOCRV4_NECK_DEPTH,
    PPOCRV4_NECK_DIMS,
    PPOCRV4_NECK_HEADS,
    PPOCRV4_NECK_MLP,
    PPOCRV4_POOL,
    PPOCRV4_SE_REDUCTION,
    PPOCRV4_STEM,
    LcnetBlock,
)


class Affine(nn.Module):
    """y = scale * x + bias with one learned scalar each (PP-LCNetV3's learnable affine)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x + self.bias


class ConvAffineAct(nn.Module):
    """The deployed LCNetV3 layer: one conv with bias (the export's fusion of the branches and
    their batch norms), an affine, hard-swish, and the activation's own affine."""

    def __init__(self, cin: int, cout: int, kernel: int, stride=(1, 1), groups: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups)
        self.affine = Affine()
        self.act_affine = Affine()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act_affine(F.hardswish(self.affine(self.conv(x))))


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.reduce = nn.Conv2d(channels, channels // PPOCRV4_SE_REDUCTION, 1)
        self.expand = nn.Conv2d(channels // PPOCRV4_SE_REDUCTION, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = F.adaptive_avg_pool2d(x, 1)
        return x * F.hardsigmoid(self.expand(F.relu(self.reduce(weight))))


class LcnetLayer(nn.Module):
    def __init__(self, block: LcnetBlock):
        super().__init__()
        cin, cout = block.in_channels, block.out_channels
        self.depthwise = ConvAffineAct(cin, cin, block.kernel, block.stride, groups=cin)
        self.se = SqueezeExcite(cin) if block.squeeze_excite else nn.Identity()
        self.pointwise = ConvAffineAct(cin, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise(self.se(self.depthwise(x)))


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, PPOCRV4_STEM, 3, 2, 1, bias=False)
        self.stem_bn = nn.BatchNorm2d(PPOCRV4_STEM, eps=PPOCRV4_BN_EPS)
        self.blocks = nn.Sequential(*(LcnetLayer(block) for block in PPOCRV4_BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem_bn(self.stem(x)))
        return F.avg_pool2d(x, PPOCRV4_POOL, PPOCRV4_POOL)


class ConvBnSwish(nn.Sequential):
    def __init__(self, cin: int, cout: int, kernel: tuple[int, int]):
        padding = (kernel[0] // 2, kernel[1] // 2)
        super().__init__(
            nn.Conv2d(cin, cout, kernel, padding=padding, bias=False),
            nn.BatchNorm2d(cout, eps=PPOCRV4_BN_EPS),
            nn.SiLU(),
        )


class Attention(nn.Module):
    def __init__(self, dims: int, heads: int):
        super().__init__()
        self.heads = heads
        self.scale = (dims // heads) ** -0.5
        self.qkv = nn.Linear(dims, dims * 3)
        self.proj = nn.Linear(dims, dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, steps, dims = x.shape
        qkv = self.qkv(x).reshape(n, steps, 3, self.heads, dims // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [N, heads, steps, head dims]
        weights = ((q * self.scale) @ k.transpose(-2, -1)).softmax(-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(n, steps, dims))


class TransformerBlock(nn.Module):
    def __init__(self, dims: int, heads: int, mlp: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dims, eps=PPOCRV4_BLOCK_EPS)
        self.attention = Attention(dims, heads)
        self.norm2 = nn.LayerNorm(dims, eps=PPOCRV4_BLOCK_EPS)
        self.fc1 = nn.Linear(dims, mlp)
        self.fc2 = nn.Linear(mlp, dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.fc2(F.silu(self.fc1(self.norm2(x))))


class SvtrNeck(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        dims = PPOCRV4_NECK_DIMS
        self.reduce = ConvBnSwish(channels, channels // 8, (1, 3))
        self.embed = ConvBnSwish(channels // 8, dims, (1, 1))
        self.blocks = nn.Sequential(
            *(
                TransformerBlock(dims, PPOCRV4_NECK_HEADS, PPOCRV4_NECK_MLP)
                for _ in range(PPOCRV4_NECK_DEPTH)
            )
        )
        self.norm = nn.LayerNorm(dims, eps=PPOCRV4_FINAL_EPS)
        self.expand = ConvBnSwish(dims, channels, (1, 1))
        self.fuse = ConvBnSwish(2 * channels, channels // 8, (1, 3))
        self.out = ConvBnSwish(channels // 8, dims, (1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        z = self.embed(self.reduce(x))
        n, dims, height, width = z.shape
        tokens = self.norm(self.blocks(z.flatten(2).transpose(1, 2)))  # [N, H*W, dims]
        z = tokens.reshape(n, height, width, dims).permute(0, 3, 1, 2)
        z = self.out(self.fuse(torch.cat([shortcut, self.expand(z)], dim=1)))
        return z.squeeze(2).transpose(1, 2)  # [N, W/8, dims]


class PpocrV4Rec(nn.Module):
    def __init__(self, num_classes: int):
        super().__init__()
        self.backbone = Backbone()
        self.neck = SvtrNeck(PPOCRV4_BLOCKS[-1].out_channels)
        self.head = nn.Linear(PPOCRV4_NECK_DIMS, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.neck(self.backbone(images)))


def load_released(net: PpocrV4Rec, released) -> list[str]:
    """Copy the released weights (train/ppocrv4_weights.py's Released) into ``net``; return
    the report, one line per tensor. Raises WeightsError, ``net`` untouched, on a mismatch."""
    from train.ppocrv4_weights import map_weights

    state = net.state_dict()
    targets = [(k, tuple(v.shape)) for k, v in state.items() if "num_batches_tracked" not in k]
    weights, report = map_weights(released, targets, linear_transposed=True)
    with torch.no_grad():
        for key, array in weights.items():
            state[key].copy_(torch.from_numpy(array))
    return report
