//! Cross-entropy on CubeCL backends.

use burn::tensor::{DType, TensorMetadata, ops::{FloatTensor, IntTensor}};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use kiln_kernels::cross_entropy::{BackwardArgs, CrossEntropyPlan, ForwardArgs, launch_backward, launch_forward};

use super::CrossEntropyBackend;
use crate::backend::cube::{dense, dense_f32, dense_words, empty_like_device, storage};

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> CrossEntropyBackend for CubeBackend<R, F, I, BT> {
    fn cross_entropy_forward(logits: FloatTensor<Self>, targets: IntTensor<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (logits, targets) = (dense(logits), dense_words::<R, F, I, BT>(targets));
        let [rows, width] = logits.shape().dims();
        let plan = CrossEntropyPlan::new(&logits.client, width, logits.dtype.size());
        let loss = empty_like_device(&logits, [rows], DType::F32);
        let lse = empty_like_device(&logits, [rows], DType::F32);
        let args = ForwardArgs {
            logits: logits.clone().into_array_arg(),
            targets: targets.into_array_arg(),
            loss: loss.clone().into_array_arg(),
            lse: lse.clone().into_array_arg(),
        };
        launch_forward(&logits.client, &plan, storage(&logits), rows, width, args);
        (loss, lse)
    }

    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let (logits, targets) = (dense(logits), dense_words::<R, F, I, BT>(targets));
        let (lse, dloss) = (dense_f32::<R, F, I, BT>(lse), dense_f32::<R, F, I, BT>(dloss));
        let [rows, width] = logits.shape().dims();
        let plan = CrossEntropyPlan::new(&logits.client, width, logits.dtype.size());
        let dlogits = empty_like_device(&logits, [rows, width], logits.dtype);
        let args = BackwardArgs {
            logits: logits.clone().into_array_arg(),
            targets: targets.into_array_arg(),
            lse: lse.into_array_arg(),
            dloss: dloss.into_array_arg(),
            dlogits: dlogits.clone().into_array_arg(),
        };
        launch_backward(&logits.client, &plan, storage(&logits), rows, width, args);
        dlogits
    }
}
