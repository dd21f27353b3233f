"""A pytest plugin that looks for unordered variable accesses in every TF1
Session run of a test session (graph_races.py), for sweeping the suite:

  KFAC_RACE_SWEEP=/tmp/races.jsonl .venv/bin/python -m pytest kfac \\
      -p kfac.python.kernel_tests.race_sweep -m "not slow" -n 2

Each distinct (graph, fetches) is analysed once; every race found is
appended to the file as one JSON line with the test's node id. Not part of
`make test` (the graph_races_test.py cases are): a sweep of the whole suite
analyses thousands of graphs.
"""

import json
import os

import pytest

_STATE = {"test": None, "seen": set()}


def _flatten(fetches):
  """The leaves of nested lists, tuples and dicts (dict keys may be of
  mixed types, as MonitoredSession's hook fetches are: no sorting)."""
  if isinstance(fetches, dict):
    return [x for v in fetches.values() for x in _flatten(v)]
  if isinstance(fetches, (list, tuple)):
    return [x for v in fetches for x in _flatten(v)]
  return [fetches]


def _fetch_ops(graph, fetches):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  out = []
  for f in _flatten(fetches):
    if f is None:
      continue
    try:
      el = graph.as_graph_element(f, allow_tensor=True, allow_operation=True)
    except Exception:  # pylint: disable=broad-except
      continue
    out.append(el if isinstance(el, tf.Operation) else el.op)
  return out


def _patch(path):
  from tensorflow.python.client import session  # pylint: disable=g-import-not-at-top
  from kfac.python.kernel_tests import graph_races  # pylint: disable=g-import-not-at-top
  original = session.BaseSession.run

  def run(self, fetches, *args, **kwargs):
    try:
      ops = _fetch_ops(self.graph, fetches)
      key = (id(self.graph), len(self.graph.get_operations()),
             tuple(sorted(op.name for op in ops)))
      if ops and key not in _STATE["seen"]:
        _STATE["seen"].add(key)
        found = graph_races.races(ops)
        if found:
          with open(path, "a") as f:
            for race in found:
              f.write(json.dumps(dict(race._asdict(),
                                      test=_STATE["test"])) + "\n")
    except Exception as e:  # pylint: disable=broad-except
      with open(path, "a") as f:
        f.write(json.dumps({"test": _STATE["test"],
                            "error": repr(e)[:300]}) + "\n")
    return original(self, fetches, *args, **kwargs)
  session.BaseSession.run = run


def pytest_configure(config):
  del config
  path = os.environ.get("KFAC_RACE_SWEEP")
  if path:
    _patch(path)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
  _STATE["test"] = item.nodeid
  yield
