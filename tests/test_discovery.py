"""Discovery on the shapes real models take: stages that chain blocks, sublayers, experts, conv layers."""

from torch import nn

from remat.planning.basics.discovery import candidate_modules


class ConvLayer(nn.Module):  # conv + norm + activation: a layer, as in Hugging Face's ResNet
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm, self.act = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()


class Residual(nn.Module):  # a block: it chains two conv layers in a Sequential
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(ConvLayer(), ConvLayer())


class Stage(nn.Module):
    def __init__(self, blocks: int, as_list: bool) -> None:
        super().__init__()
        self.downsample = nn.Conv2d(4, 4, 1)
        made = [Residual() for _ in range(blocks)]
        self.layers = nn.ModuleList(made) if as_list else nn.Sequential(*made)


class Net(nn.Module):
    def __init__(self, as_list: bool) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3)
        self.stages = nn.ModuleList(Stage(n, as_list) for n in (2, 3))


def test_a_stage_chaining_blocks_in_a_sequential_or_a_module_list_gives_its_blocks_not_their_conv_layers():
    for as_list in (False, True):
        found = candidate_modules(Net(as_list))
        assert [name for name, _ in found] == ["stages.0.layers.0", "stages.0.layers.1", "stages.1.layers.0",
                                               "stages.1.layers.1", "stages.1.layers.2"]


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(8, 8), nn.Linear(8, 8)


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)


class SublayerBlock(nn.Module):  # T5's shape: a ModuleList of distinct sublayers
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList([Attention(), FeedForward()])


class ExpertBlock(nn.Module):  # a mixture of experts: a ModuleList of one class, run side by side
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.experts = nn.ModuleList(FeedForward() for _ in range(4))


def test_sublayers_and_experts_are_parts_of_a_block():
    for block in (SublayerBlock, ExpertBlock):
        model = nn.Module()
        model.layers = nn.ModuleList(block() for _ in range(3))
        assert [name for name, _ in candidate_modules(model)] == ["layers.0", "layers.1", "layers.2"]
