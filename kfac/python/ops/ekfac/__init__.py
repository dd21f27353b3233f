"""EKFAC: K-FAC's Kronecker eigenbasis with corrected eigenvalues (George et
al. 2018). Register a layer with approx="ekfac" (or "ekfac_reduce"); see
docs/ekfac.md."""

from kfac.python.ops.ekfac.blocks import ConvEKFACFB
from kfac.python.ops.ekfac.blocks import ConvEKFACReduceFB
from kfac.python.ops.ekfac.blocks import EKFACKroneckerFB
from kfac.python.ops.ekfac.blocks import EmbeddingEKFACFB
from kfac.python.ops.ekfac.blocks import FullyConnectedEKFACFB
from kfac.python.ops.ekfac.blocks import FullyConnectedEKFACReduceFB
from kfac.python.ops.ekfac.blocks import FullyConnectedMultiEKFACFB
from kfac.python.ops.ekfac.factors import EigenCorrectionFactor
from kfac.python.ops.ekfac.factors import EmbeddingEigenCorrectionFactor
from kfac.python.ops.ekfac.scalings import STRATEGIES
from kfac.python.ops.ekfac.scalings import choose_strategy

__all__ = ["ConvEKFACFB", "ConvEKFACReduceFB", "EKFACKroneckerFB",
           "EmbeddingEKFACFB", "FullyConnectedEKFACFB",
           "FullyConnectedEKFACReduceFB", "FullyConnectedMultiEKFACFB",
           "EigenCorrectionFactor", "EmbeddingEigenCorrectionFactor",
           "STRATEGIES", "choose_strategy"]
