"""CurvatureMatrixVectorProductComputer against dense float64 references.

References never use kfac code. For a tiny float64 MLP (4 -> 3 tanh -> 4)
and a batch of 3, `tf.GradientTape` gives the Jacobian J of all loss inputs
(every loss tower, flattened and concatenated) w.r.t. all flattened
parameters, the Hessian H_L of sum_l c_l L_l w.r.t. those loss inputs
(written here from the textbook formulas), and the full parameter Hessian of
the total loss. Loss-input Fishers are closed forms built with numpy:
softmax diag(p) - p p^T, Bernoulli diag(p (1 - p)), Gaussian mean I / var,
Gaussian mean-variance diag(1/v, 1/(2 v^2)). Then

    F v = J^T blockdiag(c_l F_l) J v,  G v = J^T H_L J v,  H v = H_full v,

summed over the batch. Factor identities: multiply_fisher_factor of
multiply_fisher_factor_transpose(v) is F v and its squared norms sum to
v^T F v; for the GGN the signed squares sum to v^T G v, the unsigned round
trip is J^T |H_L| J v and reapplying the signs gives G v.

Tolerance: max |actual - expected| <= 1e-10 * max |expected| (float64), in
both worlds (a TF1 Session graph and a tf.function).
"""

import functools

import numpy as np
import pytest
import scipy.linalg
import tensorflow as tf

from kfac.python.kernel_tests import reference as ref
from kfac.python.ops.collection import layer_collection as lc_lib
from kfac.python.ops.curvature_matrix_vector_products import (
    CurvatureMatrixVectorProductComputer)

WORLDS = ref.WORLDS
RTOL = 1e-10
N = 3
NORMAL_VAR = 0.3
MAX_ERRORS = {}


@pytest.fixture(scope="module", autouse=True)
def _print_max_errors():
  """Prints the largest relative errors seen at the end (run with -s)."""
  yield
  print("\nmax relative errors:",
        {k: "%.1e" % v for k, v in sorted(MAX_ERRORS.items())})


# ---------------------------------------------------------------- cases
def _data(seed, kind, dout=4, embed=False):
  rng = np.random.RandomState(seed)
  x = rng.randint(0, 5, size=N) if embed else rng.randn(N, 4)
  if kind in ("categorical",):
    t = rng.randint(0, dout, size=N)
  elif kind == "onehot":
    t = np.eye(dout)[rng.randint(0, dout, size=N)]
  elif kind == "bernoulli":
    t = (rng.rand(N, dout) < 0.5).astype(np.float64)
  elif kind == "meanvar":
    t = rng.randn(N, dout // 2)
  else:
    t = rng.randn(N, dout)
  return x, t


def _spec(kind, coeff, seed, name=None, embed=False, dout=4):
  x, t = _data(seed, kind, dout, embed)
  return dict(kind=kind, coeff=coeff, x=x, targets=t, name=name or kind)


def _case(specs, sizes=(4, 3, 4), act="tanh", embed=False, seed=0):
  inits = ref.mlp_inits(sizes, seed=seed)
  if embed:
    inits = [np.random.RandomState(seed + 1).randn(5, 4)] + inits
  return dict(specs=specs, inits=inits, act=act, embed=embed)


CASES = {
    "categorical": _case([_spec("categorical", 0.7, 1)]),
    "onehot": _case([_spec("onehot", 1.3, 2)]),
    "bernoulli": _case([_spec("bernoulli", 0.4, 3)]),
    "squared": _case([_spec("squared", 0.5, 4)]),
    "normal": _case([_spec("normal", 2.0, 5)]),
    "meanvar": _case([_spec("meanvar", 1.7, 6)], seed=1),
    "two_towers": _case([_spec("categorical", 0.6, 7, name="xent"),
                         _spec("categorical", 0.6, 8, name="xent")]),
    "two_losses": _case([_spec("onehot", 0.8, 9, name="a"),
                         _spec("meanvar", 1.4, 10, name="b"),
                         _spec("squared", 0.3, 11, name="c"),
                         _spec("squared", 0.3, 12, name="c")], seed=2),
    "gather": _case([_spec("categorical", 1.1, 13, embed=True)], embed=True,
                    seed=3),
}


# ---------------------------------------------------------------- model
def _activation(act):
  return np.tanh if act == "tanh" else tf.identity


def _heads(kind, out):
  if kind == "meanvar":
    d = out.shape[-1] // 2
    return [out[:, :d], tf.exp(out[:, d:])]
  return [out]


def _forward(case, params, x):
  if case["embed"]:
    x = tf.gather(params[0], x)
    params = params[1:]
  return ref.mlp_forward(params, x, activation=_activation(case["act"]))


def _register(lc, case, variables, with_targets=True):
  seen = set()
  for s in case["specs"]:
    out = _forward(case, variables, tf.constant(s["x"]))
    z = _heads(s["kind"], out)
    t = tf.constant(s["targets"]) if with_targets else None
    # A second loss of the same name is a tower of the first (reuse=True
    # with no earlier loss of that name raises, as in kfac 0.2.x).
    kw = dict(targets=t, name=s["name"], coeff=s["coeff"],
              reuse=s["name"] in seen)
    seen.add(s["name"])
    kind = s["kind"]
    if kind in ("categorical", "onehot"):
      lc.register_softmax_cross_entropy_loss(z[0], **kw)
    elif kind == "bernoulli":
      lc.register_sigmoid_cross_entropy_loss(z[0], **kw)
    elif kind == "squared":
      lc.register_squared_error_loss(z[0], **kw)
    elif kind == "normal":
      lc.register_normal_predictive_distribution(z[0], var=NORMAL_VAR, **kw)
    else:
      lc.register_normal_mean_variance_predictive_distribution(z[0], z[1],
                                                               **kw)


# ---------------------------------------------------------------- reference
def _nll(kind, z, t):
  """Summed negative log-likelihood, written from the formulas."""
  if kind in ("categorical", "onehot"):
    onehot = tf.one_hot(t, z.shape[-1], dtype=z.dtype) if kind == (
        "categorical") else t
    return -tf.reduce_sum(onehot * tf.nn.log_softmax(z))
  if kind == "bernoulli":
    return tf.reduce_sum(tf.nn.softplus(z) - t * z)
  if kind in ("squared", "normal"):
    var = 0.5 if kind == "squared" else NORMAL_VAR
    return tf.reduce_sum(0.5 * tf.square(t - z) / var)
  mean, var = z
  return tf.reduce_sum(0.5 * tf.square(t - mean) / var + 0.5 * tf.math.log(var))


def _fisher(kind, z):
  """Closed-form Fisher w.r.t. the flattened loss inputs (numpy)."""
  if kind in ("categorical", "onehot"):
    return scipy.linalg.block_diag(*[ref.categorical_fisher(r) for r in z[0]])
  if kind == "bernoulli":
    return np.diag(ref.bernoulli_fisher(z[0].reshape(-1)).diagonal())
  if kind in ("squared", "normal"):
    var = 0.5 if kind == "squared" else NORMAL_VAR
    return np.eye(z[0].size) / var
  v = z[1].reshape(-1)
  return np.diag(np.concatenate([1.0 / v, 0.5 / v**2]))


def _unflatten(theta, inits):
  out, start = [], 0
  for a in inits:
    out.append(tf.reshape(theta[start:start + a.size], a.shape))
    start += a.size
  return out


@functools.lru_cache(maxsize=None)
def _reference(name):
  """J [M, P], blockdiag(c F) [M, M], H_L [M, M], H_full [P, P]."""
  case = CASES[name]
  specs, inits = case["specs"], case["inits"]
  theta = tf.Variable(ref.flat(inits))

  def loss_inputs(th):
    params = _unflatten(th, inits)
    return [_heads(s["kind"], _forward(case, params, tf.constant(s["x"])))
            for s in specs]

  def total(zs):
    return tf.add_n([s["coeff"] * _nll(s["kind"], z[0] if len(z) == 1 else z,
                                       tf.constant(s["targets"]))
                     for s, z in zip(specs, zs)])

  with tf.GradientTape() as tape:
    zs = loss_inputs(theta)
    zcat = tf.concat([tf.reshape(z, [-1]) for zz in zs for z in zz], 0)
  jac = tape.jacobian(zcat, theta).numpy()

  fisher = scipy.linalg.block_diag(*[
      s["coeff"] * _fisher(s["kind"], [z.numpy() for z in zz])
      for s, zz in zip(specs, zs)])

  shapes = [[z.shape for z in zz] for zz in zs]
  zvar = tf.Variable(zcat)
  with tf.GradientTape() as outer:
    with tf.GradientTape() as inner:
      pieces, start = [], 0
      for shp in shapes:
        group = []
        for s in shp:
          group.append(tf.reshape(zvar[start:start + s.num_elements()], s))
          start += s.num_elements()
        pieces.append(group)
      value = total(pieces)
    grad = inner.gradient(value, zvar)
  loss_hessian = outer.jacobian(grad, zvar).numpy()

  with tf.GradientTape() as outer:
    with tf.GradientTape() as inner:
      value = total(loss_inputs(theta))
    grad = inner.gradient(value, theta)
  full_hessian = outer.jacobian(grad, theta).numpy()
  return jac, fisher, loss_hessian, full_hessian


def _vectors(case, seed=100):
  rng = np.random.RandomState(seed)
  return [rng.randn(*a.shape) for a in case["inits"]]


def _abs_sym(mat):
  evals, evecs = np.linalg.eigh(0.5 * (mat + mat.T))
  return (evecs * np.abs(evals)) @ evecs.T


# ---------------------------------------------------------------- products
@functools.lru_cache(maxsize=None)
def _products(world, name):
  case = CASES[name]
  vecs = _vectors(case)

  def build(variables):
    lc = lc_lib.LayerCollection()
    _register(lc, case, variables)
    cmvp = CurvatureMatrixVectorProductComputer(lc, variables)
    v = [tf.constant(a) for a in vecs]
    ffac_t = cmvp.multiply_fisher_factor_transpose(v)
    gfac_t = cmvp.multiply_ggn_factor_transpose(v)
    signed = [u if s is None else u * tf.constant(s, u.dtype)
              for u, s in zip(gfac_t, cmvp.ggn_factor_signs)]
    return [dict(
        fisher=cmvp.multiply_fisher(v),
        ggn=cmvp.multiply_ggn(v),
        hessian=cmvp.multiply_hessian(v),
        ffac_t=ffac_t,
        ffac_round=cmvp.multiply_fisher_factor(ffac_t),
        gfac_t=gfac_t,
        gfac_round=cmvp.multiply_ggn_factor(gfac_t),
        gfac_signed=cmvp.multiply_ggn_factor(signed))]

  out = ref.run_stages(world, case["inits"], build)[0]
  with tf.Graph().as_default():  # signs and static factor shapes
    lc = lc_lib.LayerCollection()
    variables = [tf.constant(a) for a in case["inits"]]
    _register(lc, case, variables)
    out["signs"] = CurvatureMatrixVectorProductComputer(
        lc, variables).ggn_factor_signs
  return out, ref.flat(vecs)


def _check(what, actual, expected):
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  scale = np.max(np.abs(expected))
  assert scale > 1e-6, (what, "degenerate reference")
  err = np.max(np.abs(actual - expected)) / scale
  MAX_ERRORS[what] = max(MAX_ERRORS.get(what, 0.0), err)
  assert err <= RTOL, (what, err)


CASE_NAMES = sorted(CASES)


# Every case in the TF1 graph; in tf.function three of them in the fast tier
# (one loss family, two losses, a gathered output), all in the slow tier.
_FAST_TF2_CASES = ("categorical", "two_losses", "gather")
WORLD_CASES = [
    pytest.param(world, name, marks=() if world == "graph" or
                 name in _FAST_TF2_CASES else pytest.mark.slow)
    for name in CASE_NAMES for world in WORLDS]


@pytest.mark.parametrize("world, name", WORLD_CASES)
def test_multiply_fisher_equals_dense(world, name):
  out, v = _products(world, name)
  jac, fisher, _, _ = _reference(name)
  _check("fisher", ref.flat(out["fisher"]), jac.T @ fisher @ jac @ v)
  # Output shapes are aligned with the wrt tensors.
  for a, b in zip(out["fisher"], CASES[name]["inits"]):
    assert a.shape == b.shape


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("world", WORLDS)
def test_multiply_ggn_equals_loss_hessian_product(world, name):
  out, v = _products(world, name)
  jac, _, loss_hessian, _ = _reference(name)
  _check("ggn", ref.flat(out["ggn"]), jac.T @ loss_hessian @ jac @ v)


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("world", WORLDS)
def test_multiply_hessian_equals_tape_hessian(world, name):
  out, v = _products(world, name)
  full_hessian = _reference(name)[3]
  _check("hessian", ref.flat(out["hessian"]), full_hessian @ v)


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("world", WORLDS)
def test_fisher_factor_identities(world, name):
  out, v = _products(world, name)
  jac, fisher, _, _ = _reference(name)
  _check("fisher_factor_round_trip", ref.flat(out["ffac_round"]),
         jac.T @ fisher @ jac @ v)
  squares = sum(np.sum(u**2) for u in out["ffac_t"])
  _check("fisher_factor_quadratic_form", squares, v @ jac.T @ fisher @ jac @ v)
  # One factor-space vector per loss tower, in the loss's factor shape.
  specs = CASES[name]["specs"]
  assert len(out["ffac_t"]) == len(specs)
  for u in out["ffac_t"]:
    assert u.shape == (N, 4)  # mean-variance: [N, 2 means + 2 variances]


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("world", WORLDS)
def test_ggn_factor_identities_with_signs(world, name):
  out, v = _products(world, name)
  jac, _, loss_hessian, _ = _reference(name)
  gv = jac.T @ loss_hessian @ jac @ v
  signed = sum(np.sum(u**2 * (1.0 if s is None else s))
               for u, s in zip(out["gfac_t"], out["signs"]))
  _check("ggn_factor_quadratic_form", signed, v @ gv)
  _check("ggn_factor_signed_round_trip", ref.flat(out["gfac_signed"]), gv)
  _check("ggn_factor_round_trip_abs", ref.flat(out["gfac_round"]),
         jac.T @ _abs_sym(loss_hessian) @ jac @ v)
  kinds = [s["kind"] for s in CASES[name]["specs"]]
  for s, kind in zip(out["signs"], kinds):
    if kind == "meanvar":
      np.testing.assert_array_equal(s, [1.0, 1.0, -1.0, -1.0])
    else:
      assert s is None


def test_mean_variance_ggn_is_indefinite_and_not_the_fisher():
  out, v = _products("graph", "meanvar")
  jac, fisher, loss_hessian, _ = _reference("meanvar")
  assert np.min(np.linalg.eigvalsh(loss_hessian)) < -1e-3
  diff = np.max(np.abs(ref.flat(out["ggn"]) - ref.flat(out["fisher"])))
  assert diff > 1e-3 * np.max(np.abs(ref.flat(out["fisher"])))


# ---------------------------------------------------------------- linear
LINEAR = {
    # f linear in the parameters: GGN == Hessian for any targets.
    "one_layer": _case([_spec("squared", 0.9, 20)], sizes=(4, 4),
                       act="linear", seed=4),
    # Deep linear: the Hessian adds sum_k r_k d^2 f_k, zero at r = 0.
    "deep_zero_residual": _case([_spec("squared", 0.9, 21)],
                                sizes=(4, 3, 4), act="linear", seed=5),
}


def _zero_residual_targets(case):
  spec = case["specs"][0]
  spec["targets"] = ref.outputs(
      lambda p, x: _forward(case, p, x), case["inits"], spec["x"])


_zero_residual_targets(LINEAR["deep_zero_residual"])


def _named_products(world, case, vecs, *methods):
  """The products `methods` of CMVP on `case` with the vectors `vecs`."""

  def build(variables):
    lc = lc_lib.LayerCollection()
    _register(lc, case, variables)
    cmvp = CurvatureMatrixVectorProductComputer(lc, variables)
    v = [tf.constant(a) for a in vecs]
    return [tuple(getattr(cmvp, m)(v) for m in methods)]

  return ref.run_stages(world, case["inits"], build)[0]


@pytest.mark.parametrize("name", sorted(LINEAR))
@pytest.mark.parametrize("world", WORLDS)
def test_ggn_equals_hessian_for_linear_models(world, name):
  case = LINEAR[name]
  ggn, hess, fisher = _named_products(
      world, case, _vectors(case, seed=7), "multiply_ggn",
      "multiply_hessian", "multiply_fisher")
  _check("linear_ggn_vs_hessian", ref.flat(ggn), ref.flat(hess))
  _check("linear_fisher_vs_hessian", ref.flat(fisher), ref.flat(hess))


def test_deep_linear_hessian_differs_from_ggn_with_residuals():
  case = _case([_spec("squared", 0.9, 22)], sizes=(4, 3, 4), act="linear",
               seed=6)
  ggn, hess = _named_products("graph", case, _vectors(case, seed=8),
                              "multiply_ggn", "multiply_hessian")
  diff = np.max(np.abs(ref.flat(ggn) - ref.flat(hess)))
  assert diff > 1e-2 * np.max(np.abs(ref.flat(hess)))


# ---------------------------------------------------------------- wrt tensors
@pytest.mark.parametrize("world", WORLDS)
def test_wrt_logits_tensor_and_unconnected_variable(world):
  """wrt a loss input itself: F v = c F_L v; a wrt variable no loss reads
  gets zeros (tf.gradients gives None)."""
  case = CASES["categorical"]
  spec = case["specs"][0]
  rng = np.random.RandomState(3)
  v_logits = rng.randn(N, 4)
  v_free = rng.randn(2, 5)

  def build(variables):
    params, free = variables[:4], variables[4]
    lc = lc_lib.LayerCollection()
    logits = _forward(case, params, tf.constant(spec["x"]))
    lc.register_softmax_cross_entropy_loss(
        logits, targets=tf.constant(spec["targets"]), coeff=spec["coeff"])
    cmvp = CurvatureMatrixVectorProductComputer(
        lc, [logits, free], colocate_gradients_with_ops=False)
    v = [tf.constant(v_logits), tf.constant(v_free)]
    ffac_t = cmvp.multiply_fisher_factor_transpose(v)
    return [(cmvp.multiply_fisher(v), cmvp.multiply_ggn(v),
             cmvp.multiply_hessian(v), cmvp.multiply_fisher_factor(ffac_t),
             logits)]

  results = ref.run_stages(world, case["inits"] + [np.zeros([2, 5])],
                           build)[0]
  *products, logits = results
  expected = spec["coeff"] * np.concatenate(
      [ref.categorical_fisher(z) @ u for z, u in zip(logits, v_logits)])
  for prod in products[:2] + products[3:]:
    _check("wrt_logits", prod[0].reshape(-1), expected)
  # The Hessian w.r.t. the logits is the same (the loss is their function).
  _check("wrt_logits", products[2][0].reshape(-1), expected)
  for prod in products:
    np.testing.assert_array_equal(prod[1], np.zeros([2, 5]))


# ---------------------------------------------------------------- errors
def _graph_setup(kind="categorical", with_targets=True):
  case = CASES[kind]
  variables = [tf.Variable(a) for a in case["inits"]]
  lc = lc_lib.LayerCollection()
  _register(lc, case, variables, with_targets=with_targets)
  return lc, variables


def test_eager_call_raises_runtime_error():
  lc, variables = _graph_setup()
  cmvp = CurvatureMatrixVectorProductComputer(lc, variables)
  vecs = [tf.zeros_like(v) for v in variables]
  for method in ("multiply_fisher", "multiply_ggn", "multiply_hessian",
                 "multiply_fisher_factor_transpose",
                 "multiply_ggn_factor_transpose"):
    with pytest.raises(RuntimeError, match="tf.function"):
      getattr(cmvp, method)(vecs)


def test_bad_vectors_name_the_variable():
  with tf.Graph().as_default():
    lc, variables = _graph_setup()
    cmvp = CurvatureMatrixVectorProductComputer(lc, variables)
    good = [tf.zeros(v.shape, tf.float64) for v in variables]
    with pytest.raises(ValueError, match="Got 3 vectors for 4"):
      cmvp.multiply_fisher(good[:3])
    bad_shape = list(good)
    bad_shape[2] = tf.zeros([4, 3], tf.float64)
    name = variables[2].name.split(":")[0]
    with pytest.raises(ValueError, match="%s.*shape" % name):
      cmvp.multiply_ggn(bad_shape)
    bad_dtype = list(good)
    bad_dtype[1] = tf.zeros([3], tf.float32)
    with pytest.raises(ValueError, match="dtype float32"):
      cmvp.multiply_hessian(bad_dtype)
    with pytest.raises(ValueError, match="list aligned"):
      cmvp.multiply_fisher(good[0])
    us = cmvp.multiply_fisher_factor_transpose(good)
    with pytest.raises(ValueError, match="one factor-space vector per loss"):
      cmvp.multiply_fisher_factor(us + us)
    with pytest.raises(ValueError, match="shape"):
      cmvp.multiply_fisher_factor([tf.zeros([N, 7], tf.float64)])
    assert cmvp.wrt_tensors == variables
    assert cmvp.layer_collection is lc


def test_no_losses_and_missing_targets():
  with tf.Graph().as_default():
    variables = [tf.Variable(a) for a in CASES["categorical"]["inits"]]
    vecs = [tf.zeros(v.shape, tf.float64) for v in variables]
    cmvp = CurvatureMatrixVectorProductComputer(lc_lib.LayerCollection(),
                                                variables)
    with pytest.raises(ValueError, match="No losses registered"):
      cmvp.multiply_fisher(vecs)

    # Categorical without targets: Fisher and GGN fine, Hessian needs them.
    lc, variables = _graph_setup(with_targets=False)
    cmvp = CurvatureMatrixVectorProductComputer(lc, variables)
    cmvp.multiply_fisher(vecs)
    cmvp.multiply_ggn(vecs)
    with pytest.raises(ValueError, match="'categorical'.*no targets"):
      cmvp.multiply_hessian(vecs)

    # Mean-variance: its GGN is the Hessian at the data targets.
    lc, variables = _graph_setup("meanvar", with_targets=False)
    cmvp = CurvatureMatrixVectorProductComputer(lc, variables)
    cmvp.multiply_fisher(vecs)
    for method in ("multiply_ggn", "multiply_ggn_factor_transpose"):
      with pytest.raises(ValueError, match="targets"):
        getattr(cmvp, method)(vecs)



def test_factor_inner_shapes_match_the_factor_vectors():
  """fisher/ggn_factor_inner_(static_)shapes (old public properties) give
  the shapes multiply_*_factor take: those of the transposed products; the
  old keyword loss_inner_vecs is accepted."""
  with tf.Graph().as_default():
    lc, variables = _graph_setup()
    cmvp = CurvatureMatrixVectorProductComputer(lc, variables)
    good = [tf.zeros(v.shape, tf.float64) for v in variables]
    us = cmvp.multiply_fisher_factor_transpose(good)
    gs = cmvp.multiply_ggn_factor_transpose(good)
    assert len(cmvp.fisher_factor_inner_static_shapes) == len(us)
    for u, static in zip(us, cmvp.fisher_factor_inner_static_shapes):
      assert u.shape.as_list() == static.as_list()
    for g, static in zip(gs, cmvp.ggn_factor_inner_static_shapes):
      assert g.shape.as_list() == static.as_list()
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      dyn_f, dyn_g = sess.run([cmvp.fisher_factor_inner_shapes,
                               cmvp.ggn_factor_inner_shapes])
    assert [list(s) for s in dyn_f] == [u.shape.as_list() for u in us]
    assert [list(s) for s in dyn_g] == [g.shape.as_list() for g in gs]
    back = cmvp.multiply_fisher_factor(loss_inner_vecs=us)
    assert [b.shape for b in back] == [v.shape for v in variables]
    back = cmvp.multiply_ggn_factor(loss_inner_vecs=gs)
    assert [b.shape for b in back] == [v.shape for v in variables]
