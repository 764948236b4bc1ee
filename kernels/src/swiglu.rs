//! Gated linear units `act(gate) · up`: SwiGLU (`silu`, Llama/Qwen MLPs), GeGLU (tanh-approximated
//! GELU, Gemma MLPs) and the squared-ReLU GLU of BitNet b1.58. One pass reads both inputs and writes the product; the backward reads
//! `gate`, `up` and `dy` once and writes both gradients, recomputing the activation instead of
//! storing it. Arithmetic is f32 whatever the storage dtype.

use crate::row::elementwise_geometry;
use cubecl::prelude::*;

/// The gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum GluActivation {
    /// `x · sigmoid(x)`.
    Silu,
    /// `0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 x³)))`.
    GeluTanh,
    /// `max(x, 0)²` (HF's `relu2`, BitNet b1.58's MLP).
    Relu2,
}

impl GluActivation {
    /// The name of the kiln op that gates with this activation (for error messages).
    pub fn op_name(self) -> &'static str {
        match self {
            Self::Silu => "swiglu",
            Self::GeluTanh => "geglu",
            Self::Relu2 => "relu2_glu",
        }
    }
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_CUBIC: f32 = 0.044_715;

/// `(act(g), act'(g))` in f32.
#[cube]
fn activation<N: Size>(g: Vector<f32, N>, #[comptime] act: GluActivation) -> (Vector<f32, N>, Vector<f32, N>) {
    let one = Vector::<f32, N>::new(1.0);
    match act {
        GluActivation::Silu => {
            let sig = one / (one + (Vector::new(0.0) - g).exp());
            (g * sig, sig * (one + g * (one - sig)))
        }
        GluActivation::GeluTanh => {
            let half = Vector::<f32, N>::new(0.5);
            let k0 = Vector::<f32, N>::new(SQRT_2_OVER_PI);
            let k1 = Vector::<f32, N>::new(GELU_CUBIC);
            let g2 = g * g;
            let t = (k0 * (g + k1 * g2 * g)).tanh();
            let value = half * g * (one + t);
            let slope = half * (one + t)
                + half * g * (one - t * t) * k0 * (one + Vector::<f32, N>::new(3.0) * k1 * g2);
            (value, slope)
        }
        GluActivation::Relu2 => {
            let r = max(g, Vector::new(0.0));
            (r * r, Vector::<f32, N>::new(2.0) * r)
        }
    }
}

#[cube(launch_unchecked)]
fn glu_forward_kernel<F: Float, N: Size>(
    gate: &Array<Vector<F, N>>,
    up: &Array<Vector<F, N>>,
    out: &mut Array<Vector<F, N>>,
    total: usize,
    #[comptime] act: GluActivation,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= total {
        terminate!();
    }
    let (a, _) = activation(Vector::<f32, N>::cast_from(gate[i]), act);
    out[i] = Vector::cast_from(a * Vector::<f32, N>::cast_from(up[i]));
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn glu_backward_kernel<F: Float, N: Size>(
    gate: &Array<Vector<F, N>>,
    up: &Array<Vector<F, N>>,
    dy: &Array<Vector<F, N>>,
    d_gate: &mut Array<Vector<F, N>>,
    d_up: &mut Array<Vector<F, N>>,
    total: usize,
    #[comptime] act: GluActivation,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= total {
        terminate!();
    }
    let g = Vector::<f32, N>::cast_from(gate[i]);
    let u = Vector::<f32, N>::cast_from(up[i]);
    let d = Vector::<f32, N>::cast_from(dy[i]);
    let (a, slope) = activation(g, act);
    d_gate[i] = Vector::cast_from(d * u * slope);
    d_up[i] = Vector::cast_from(d * a);
}

/// Launch `out = act(gate) · up` over `len` contiguous elements, `vector_size` dividing `len`.
#[allow(clippy::too_many_arguments)]
pub fn launch_forward<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    len: usize,
    vector_size: usize,
    act: GluActivation,
    gate: ArrayArg<R>,
    up: ArrayArg<R>,
    out: ArrayArg<R>,
) {
    let total = len / vector_size;
    if total == 0 {
        return;
    }
    let (count, dim) = elementwise_geometry(client, total);
    // SAFETY: all three tensors are contiguous with `len` elements; units past `total` exit.
    unsafe {
        glu_forward_kernel::launch_unchecked::<R>(client, count, dim, vector_size, gate, up, out, total, act, dtype)
    }
}

/// Launch the backward: `d_gate = dy · up · act'(gate)`, `d_up = dy · act(gate)`.
#[allow(clippy::too_many_arguments)]
pub fn launch_backward<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    len: usize,
    vector_size: usize,
    act: GluActivation,
    gate: ArrayArg<R>,
    up: ArrayArg<R>,
    dy: ArrayArg<R>,
    d_gate: ArrayArg<R>,
    d_up: ArrayArg<R>,
) {
    let total = len / vector_size;
    if total == 0 {
        return;
    }
    let (count, dim) = elementwise_geometry(client, total);
    // SAFETY: all five tensors are contiguous with `len` elements; units past `total` exit.
    unsafe {
        glu_backward_kernel::launch_unchecked::<R>(
            client, count, dim, vector_size, gate, up, dy, d_gate, d_up, total, act, dtype,
        )
    }
}
