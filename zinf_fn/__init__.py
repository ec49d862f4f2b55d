"""zinf-fn: ZeRO-Infinity as a functional training engine over PyTorch."""

from .config import Config
from .model import Model, Stage, Tie, TokenLoss, plain_loss, token_mean
from .optim.optimizers import Optimizer, adamw, sgd
from .plan import auto_config, calibrate, estimate, gather_params, plan
from .train import TrainState, eval_step, init, train_step

__all__ = [
    "Config", "Model", "Optimizer", "Stage", "Tie", "TokenLoss", "TrainState", "adamw", "auto_config", "calibrate",
    "estimate", "eval_step", "gather_params", "init", "plain_loss", "plan", "sgd", "token_mean", "train_step",
]
