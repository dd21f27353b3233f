"""Old import path kfac.python.ops.kfac_utils.data_reader_alt: see
kfac/python/ops/data/data_reader_alt.py."""

from kfac.python.ops.data.data_reader_alt import CachedDataReader  # pylint: disable=unused-import
from kfac.python.ops.data.data_reader_alt import VariableBatchReader  # pylint: disable=unused-import
