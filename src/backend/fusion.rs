//! One generic way to put a kiln op into Burn's fusion stream.
//!
//! Burn's `Cuda` and `Wgpu` are `Fusion<CubeBackend<..>>`: operations are recorded and executed
//! lazily. A kiln op is registered as a custom operation whose execution calls the inner
//! backend's implementation of the same op (the CubeCL kernel); fusion orders it against the
//! surrounding operations and frees its inputs like any other operation.

use core::fmt::Debug;
use core::marker::PhantomData;

use burn::tensor::{DType, Shape, ops::{FloatTensor, IntTensor}};
use burn_fusion::{
    Fusion, FusionBackend, FusionRuntime, FusionTensor,
    stream::{Operation, OperationStreams},
};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

/// The body of a custom fusion operation: float inputs in, float outputs out, on the inner
/// backend. Implementors carry the op's non-tensor parameters.
pub(crate) trait FusedOp<B: FusionBackend>: Clone + Debug + Send + Sync + 'static {
    fn run(&self, inputs: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>>;
}

/// A tensor of either kind, for ops with integer operands (packed quantized weights).
pub(crate) enum Operand<T, I> {
    Float(T),
    Int(I),
}

impl<T, I> Operand<T, I> {
    /// The float tensor of an op's input taken in the op's own operand order; `op` names the op in
    /// the panic that a missing or int operand (a bug in that order) raises.
    pub(crate) fn float(operand: Option<Self>, op: &str) -> T {
        match operand {
            Some(Operand::Float(t)) => t,
            _ => unreachable!("{op} fusion op: a float operand expected"),
        }
    }

    /// [`Operand::float`] for an int operand.
    pub(crate) fn int(operand: Option<Self>, op: &str) -> I {
        match operand {
            Some(Operand::Int(t)) => t,
            _ => unreachable!("{op} fusion op: an int operand expected"),
        }
    }
}

/// The body of a custom fusion operation with float and int operands, in and out (each output's
/// kind follows its declared dtype).
pub(crate) trait FusedMixedOp<B: FusionBackend>: Clone + Debug + Send + Sync + 'static {
    fn run(&self, inputs: Vec<Operand<FloatTensor<B>, IntTensor<B>>>) -> Vec<Operand<FloatTensor<B>, IntTensor<B>>>;
}

/// A float-only op seen as a mixed one.
#[derive(Clone, Debug)]
struct FloatsOnly<O>(O);

impl<B: FusionBackend, O: FusedOp<B>> FusedMixedOp<B> for FloatsOnly<O> {
    fn run(&self, inputs: Vec<Operand<FloatTensor<B>, IntTensor<B>>>) -> Vec<Operand<FloatTensor<B>, IntTensor<B>>> {
        let floats = inputs
            .into_iter()
            .map(|t| match t {
                Operand::Float(t) => t,
                Operand::Int(_) => unreachable!("float-only op given an int tensor"),
            })
            .collect();
        self.0.run(floats).into_iter().map(Operand::Float).collect()
    }
}

#[derive(Clone, Debug)]
struct CustomOp<B, O> {
    desc: CustomOpIr,
    op: O,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend, O: FusedMixedOp<B>> Operation<B::FusionRuntime> for CustomOp<B, O> {
    fn execute(&self, handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>) {
        let inputs = self
            .desc
            .inputs
            .iter()
            .map(|t| if t.dtype.is_float() { Operand::Float(handles.get_float_tensor::<B>(t)) } else { Operand::Int(handles.get_int_tensor::<B>(t)) })
            .collect();
        let outputs = self.op.run(inputs);
        assert_eq!(outputs.len(), self.desc.outputs.len(), "kiln fusion op `{}` output count", self.desc.id);
        for (ir, tensor) in self.desc.outputs.iter().zip(outputs) {
            match tensor {
                Operand::Float(t) => handles.register_float_tensor::<B>(&ir.id, t),
                Operand::Int(t) => handles.register_int_tensor::<B>(&ir.id, t),
            }
        }
    }
}

/// Record `op` named `name` on the fusion stream of `inputs` and return its outputs, whose shapes
/// and dtypes are given up front.
pub(crate) fn register<B: FusionBackend, O: FusedOp<B>>(
    name: &'static str,
    inputs: Vec<FloatTensor<Fusion<B>>>,
    outputs: Vec<(Shape, DType)>,
    op: O,
) -> Vec<FusionTensor<B::FusionRuntime>> {
    register_mixed(name, inputs, outputs, FloatsOnly(op))
}

/// [`register`] for ops with int operands: `inputs` may hold tensors of either kind (a fusion
/// tensor carries its dtype), and an output is an int tensor when its dtype is an int one.
pub(crate) fn register_mixed<B: FusionBackend, O: FusedMixedOp<B>>(
    name: &'static str,
    inputs: Vec<FusionTensor<B::FusionRuntime>>,
    outputs: Vec<(Shape, DType)>,
    op: O,
) -> Vec<FusionTensor<B::FusionRuntime>> {
    let client = inputs[0].client.clone();
    register_on(name, client, inputs, outputs, op)
}

/// [`register_mixed`] for an op without inputs (a generator) on `device`.
pub(crate) fn register_source<B: FusionBackend, O: FusedMixedOp<B>>(
    name: &'static str,
    device: &B::Device,
    outputs: Vec<(Shape, DType)>,
    op: O,
) -> Vec<FusionTensor<B::FusionRuntime>> {
    register_on(name, burn_fusion::get_client::<B>(device), Vec::new(), outputs, op)
}

fn register_on<B: FusionBackend, O: FusedMixedOp<B>>(
    name: &'static str,
    client: burn_fusion::Client<B::FusionRuntime>,
    inputs: Vec<FusionTensor<B::FusionRuntime>>,
    outputs: Vec<(Shape, DType)>,
    op: O,
) -> Vec<FusionTensor<B::FusionRuntime>> {
    let streams = OperationStreams::with_inputs(inputs.iter());
    let outputs: Vec<TensorIr> = outputs
        .into_iter()
        .map(|(shape, dtype)| TensorIr::uninit(client.create_empty_handle(), shape, dtype))
        .collect();
    let inputs: Vec<TensorIr> = inputs.into_iter().map(FusionTensor::into_ir).collect();
    let desc = CustomOpIr::new(name, &inputs, &outputs);
    client.register(
        streams,
        OperationIr::Custom(desc.clone()),
        CustomOp::<B, O> {
            desc,
            op,
            _backend: PhantomData,
        },
    )
}
