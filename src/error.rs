//! Input validation shared by every op. Like Burn's own tensor ops, kiln panics on invalid
//! input; the message always names the op and the offending shapes or dtypes.

use burn::tensor::DType;

/// Panic with `kiln::<op>: <message>` unless `condition` holds.
#[track_caller]
pub(crate) fn ensure(condition: bool, op: &str, message: impl FnOnce() -> String) {
    if !condition {
        panic!("kiln::{op}: {}", message());
    }
}

/// All dtypes equal, named in the message if not.
#[track_caller]
pub(crate) fn ensure_same_dtype(op: &str, named: &[(&str, DType)]) {
    let first = named[0].1;
    ensure(named.iter().all(|(_, d)| *d == first), op, || {
        let list: Vec<String> = named.iter().map(|(n, d)| format!("{n}: {d:?}")).collect();
        format!("inputs must share one float dtype, got {}", list.join(", "))
    });
}

/// A float dtype the kernels compute in (f32 accumulation for all of them).
#[track_caller]
pub(crate) fn ensure_float(op: &str, name: &str, dtype: DType) {
    ensure(
        matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::Flex32 | DType::F64),
        op,
        || format!("{name} has dtype {dtype:?}; expected a float dtype"),
    );
}
