"""Old import path kfac.python.ops.kfac_utils.data_reader: see
kfac/python/ops/data/data_reader.py."""

from kfac.python.ops.data.data_reader import CachedDataReader  # pylint: disable=unused-import
from kfac.python.ops.data.data_reader import VariableBatchReader  # pylint: disable=unused-import
