//! Cross-entropy of rows of logits against integer targets, the language-model loss:
//! `loss[r] = lse[r] − z[r, t[r]]` with `lse[r] = log Σ_j exp(z[r, j])`, in f32 whatever the
//! logits' dtype, and its gradient `dz[r, j] = g[r] · (exp(z[r, j] − lse[r]) − [j = t[r]])` in
//! the logits' dtype.
//!
//! The forward reads each row once (a running maximum and a rescaled sum of exponentials per unit,
//! merged across the row's units at the end) and saves `lse` (4 bytes a row) for the backward,
//! which reads the row once more and writes its gradient. Nothing of the size of the logits is
//! written by the forward: composed Burn ops cast the logits to f32 and keep a log-softmax of
//! that size for the backward, several times the logits' own bytes at a 128k vocabulary.
//!
//! Targets: a negative target (PyTorch's `ignore_index` −100 among them) leaves its row out, loss
//! 0 and gradient 0; a target at or past the row width gives a NaN loss and gradient, so that a
//! vocabulary mismatch shows instead of training on a wrong row.

use crate::row::{RowLayout, row_index, row_max, row_sum, vector_size_for};
use cubecl::prelude::*;

/// Below every finite logit: the running maximum of a unit that has seen nothing yet.
const NONE: f32 = -3.0e38;

/// Vectors a unit loads before it uses them, so that several loads are in flight.
const BATCH: usize = 4;

/// `(loss, lse)` of each row; one or more rows a cube (`layout`), units striding over a row.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn cross_entropy_forward_kernel<F: Float, N: Size>(
    logits: &Array<Vector<F, N>>,
    targets: &Array<i32>,
    loss: &mut Array<f32>,
    lse: &mut Array<f32>,
    rows: usize,
    width: usize,
    #[comptime] layout: RowLayout,
    #[define(F)] _dtype: StorageType,
) {
    let row = row_index(layout);
    let row_valid = row < rows;
    let width_vectors = width / N::value();
    let base = row * width_vectors;
    let mut target = i32::new(-1);
    if row_valid {
        target = targets[row];
    }
    let (target_vector, target_lane) = target_position(target, width, width_vectors, N::value());
    let stride = layout.units_per_row;
    let mut m = f32::new(NONE);
    let mut s = 0.0f32;
    let mut picked = 0.0f32;
    let mut col = UNIT_POS_X as usize;
    while row_valid && col < width_vectors {
        let mut values = Array::<Vector<f32, N>>::new(BATCH);
        #[unroll]
        for u in 0..BATCH {
            let c = col + u * stride;
            let mut v = Vector::<f32, N>::new(0.0);
            if c < width_vectors {
                v = Vector::cast_from(logits[base + c]);
            }
            values[u] = v;
        }
        #[unroll]
        for u in 0..BATCH {
            let c = col + u * stride;
            if c < width_vectors {
                let v = values[u];
                let mut top = v[0];
                #[unroll]
                for i in 1..N::value() {
                    top = top.max(v[i]);
                }
                if top > m {
                    s *= (m - top).exp();
                    m = top;
                }
                #[unroll]
                for i in 0..N::value() {
                    s += (v[i] - m).exp();
                }
                if c == target_vector {
                    #[unroll]
                    for i in 0..N::value() {
                        if i == target_lane {
                            picked = v[i];
                        }
                    }
                }
            }
        }
        col += BATCH * stride;
    }
    let top = row_max(m, layout);
    let total = row_sum(s * (m - top).exp(), layout);
    // One unit of the row found the target's logit; the others add zeros.
    let z = row_sum(picked, layout);
    if row_valid && UNIT_POS_X == 0 {
        let l = top + total.ln();
        lse[row] = l;
        let mut value = 0.0f32;
        if target >= 0 {
            value = l - z;
            if target_vector >= width_vectors {
                value = nan(l);
            }
        }
        loss[row] = value;
    }
}

/// `dz = g · (exp(z − lse) − onehot(t))` of each row, in the logits' dtype.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn cross_entropy_backward_kernel<F: Float, N: Size>(
    logits: &Array<Vector<F, N>>,
    targets: &Array<i32>,
    lse: &Array<f32>,
    dloss: &Array<f32>,
    dlogits: &mut Array<Vector<F, N>>,
    rows: usize,
    width: usize,
    #[comptime] layout: RowLayout,
    #[define(F)] _dtype: StorageType,
) {
    let row = row_index(layout);
    if row >= rows {
        terminate!();
    }
    let width_vectors = width / N::value();
    let base = row * width_vectors;
    let target = targets[row];
    let (target_vector, target_lane) = target_position(target, width, width_vectors, N::value());
    let l = Vector::<f32, N>::new(lse[row]);
    let mut g = dloss[row];
    if target_vector >= width_vectors {
        g = nan(g);
    }
    let gv = Vector::<f32, N>::new(g);
    let stride = layout.units_per_row;
    let mut col = UNIT_POS_X as usize;
    while col < width_vectors {
        let mut values = Array::<Vector<f32, N>>::new(BATCH);
        #[unroll]
        for u in 0..BATCH {
            let c = col + u * stride;
            let mut v = Vector::<f32, N>::new(0.0);
            if c < width_vectors {
                v = Vector::cast_from(logits[base + c]);
            }
            values[u] = v;
        }
        #[unroll]
        for u in 0..BATCH {
            let c = col + u * stride;
            if c < width_vectors {
                let mut d = Vector::<f32, N>::new(0.0);
                if target >= 0 {
                    let p = (values[u] - l).exp();
                    d = p * gv;
                    if c == target_vector {
                        #[unroll]
                        for i in 0..N::value() {
                            if i == target_lane {
                                d[i] = (p[i] - 1.0) * g;
                            }
                        }
                    }
                }
                dlogits[base + c] = Vector::cast_from(d);
            }
        }
        col += BATCH * stride;
    }
}

/// The vector and lane holding target `t` in a row of `width` elements, `vector_size` a vector;
/// the vector is `width_vectors` (no vector of the row) for a target outside the row, which
/// the callers read as NaN for targets past the row and as an ignored row for negative ones.
#[cube]
fn target_position(t: i32, width: usize, width_vectors: usize, #[comptime] vector_size: usize) -> (usize, usize) {
    let mut vector = width_vectors;
    let mut lane = 0usize;
    if t >= 0 && (t as usize) < width {
        vector = t as usize / vector_size;
        lane = t as usize % vector_size;
    }
    (vector, lane)
}

/// A quiet NaN made at run time (WGSL has no NaN literal): `(x − x) / (x − x)`.
#[cube]
fn nan(x: f32) -> f32 {
    let zero = x - x;
    zero / zero
}

/// Launch plan for rows of `width` logits of `elem_size` bytes: 16-byte loads where the width
/// allows, units striding over each row ([`RowLayout::streaming`]).
#[derive(Debug, Clone, Copy)]
pub struct CrossEntropyPlan {
    pub vector_size: usize,
    pub layout: RowLayout,
}

impl CrossEntropyPlan {
    pub fn new<R: Runtime>(client: &ComputeClient<R>, width: usize, elem_size: usize) -> Self {
        let vector_size = vector_size_for(client, width, elem_size, 16);
        Self { vector_size, layout: RowLayout::streaming(client, width / vector_size, 2 * BATCH) }
    }
}

/// The buffers of a forward launch: logits `[rows, width]` dense, targets `[rows]` i32, and the
/// f32 outputs `loss` and `lse` `[rows]`.
pub struct ForwardArgs<R: Runtime> {
    pub logits: ArrayArg<R>,
    pub targets: ArrayArg<R>,
    pub loss: ArrayArg<R>,
    pub lse: ArrayArg<R>,
}

/// Launch the forward over `rows` rows of `width` logits of `dtype`.
pub fn launch_forward<R: Runtime>(client: &ComputeClient<R>, plan: &CrossEntropyPlan, dtype: StorageType, rows: usize, width: usize, args: ForwardArgs<R>) {
    if rows == 0 {
        return;
    }
    // SAFETY: the logits hold `rows × width` contiguous elements (`vector_size` divides `width`),
    // targets, loss and lse `rows`; the kernel bound-checks rows and columns against those sizes.
    unsafe {
        cross_entropy_forward_kernel::launch_unchecked::<R>(
            client,
            plan.layout.cube_count(client, rows),
            plan.layout.cube_dim(),
            plan.vector_size,
            args.logits,
            args.targets,
            args.loss,
            args.lse,
            rows,
            width,
            plan.layout,
            dtype,
        )
    }
}

/// The buffers of a backward launch: the forward's logits, targets and `lse`, the loss gradient
/// `[rows]` f32, and the logits' gradient (shaped and typed as the logits).
pub struct BackwardArgs<R: Runtime> {
    pub logits: ArrayArg<R>,
    pub targets: ArrayArg<R>,
    pub lse: ArrayArg<R>,
    pub dloss: ArrayArg<R>,
    pub dlogits: ArrayArg<R>,
}

/// Launch the backward over `rows` rows of `width` logits of `dtype`.
pub fn launch_backward<R: Runtime>(client: &ComputeClient<R>, plan: &CrossEntropyPlan, dtype: StorageType, rows: usize, width: usize, args: BackwardArgs<R>) {
    if rows == 0 {
        return;
    }
    // SAFETY: as for the forward; `dlogits` holds `rows × width` elements.
    unsafe {
        cross_entropy_backward_kernel::launch_unchecked::<R>(
            client,
            plan.layout.cube_count(client, rows),
            plan.layout.cube_dim(),
            plan.vector_size,
            args.logits,
            args.targets,
            args.lse,
            args.dloss,
            args.dlogits,
            rows,
            width,
            plan.layout,
            dtype,
        )
    }
}
