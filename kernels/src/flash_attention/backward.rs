//! The backward of [`super`]'s attention: `delta = Σ dO·O` per row ([`launch_row_dot`]), then dQ,
//! dK and dV ([`launch_backward`]) from the forward's log-sum-exp, on the tensor cores
//! ([`super::mma`]) or the portable kernels here (a dQ kernel over query rows, a dK/dV kernel over
//! key rows).

use cubecl::ir::{ElemType, FloatKind, features::AtomicUsage};
use cubecl::prelude::*;

use super::plan::BLOCK_ROWS;
use super::*;
use crate::row::{RowLayout, lane_sum, row_index, row_sum, vector_size_for};

/// Strides, in vectors, of the first three axes of a `[batch, heads, len, width]` operand of
/// [`row_dot_kernel`].
#[derive(CubeLaunch, CubeType)]
pub struct VectorStrides {
    batch: u32,
    head: u32,
    row: u32,
}

#[cube]
impl VectorStrides {
    /// The first vector of row `pos` of (`batch`, `head`).
    fn at(&self, batch: usize, head: usize, pos: usize) -> usize {
        batch * self.batch as usize + head * self.head as usize + pos * self.row as usize
    }
}

/// `delta[row] = Σ d_out[row, :] · out[row, :]` in f32 over `[batch, heads, len, width]` tensors
/// with unit-stride rows at any strides of their first three axes (in vectors), `delta` dense
/// `[batch, heads, len]`: the backward's `D`, one read of each input (Burn ops took two casts, a
/// product and a sum, five passes over f32 copies). The strides let the Hopper forward's output
/// and the gradient that reaches it stay in the `[batch, len, heads, width]` layout a model's
/// projections read and write.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn row_dot_kernel<F: Float, N: Size>(
    d_out: &Array<Vector<F, N>>,
    out: &Array<Vector<F, N>>,
    delta: &mut Array<f32>,
    rows: usize,
    width: usize,
    heads: usize,
    len: usize,
    d_out_strides: VectorStrides,
    out_strides: VectorStrides,
    #[comptime] layout: RowLayout,
    #[define(F)] _dtype: StorageType,
) {
    let row = row_index(layout);
    let width_vectors = width / N::value();
    let (batch, head, pos) = (row / (heads * len), (row / len) % heads, row % len);
    let d_out_base = d_out_strides.at(batch, head, pos);
    let out_base = out_strides.at(batch, head, pos);
    let mut sum = Vector::<f32, N>::new(0.0);
    #[unroll]
    for i in 0..layout.vectors_per_unit {
        let col = i * layout.units_per_row + UNIT_POS_X as usize;
        if row < rows && col < width_vectors {
            sum += Vector::cast_from(d_out[d_out_base + col]) * Vector::cast_from(out[out_base + col]);
        }
    }
    let total = row_sum(lane_sum(sum), layout);
    if row < rows && UNIT_POS_X == 0 {
        delta[row] = total;
    }
}

/// dQ. Grid and rows as the forward (no splits); `delta` is `Σ dO·O` per row (f32
/// `[batch, q_heads, q_len]`).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn backward_q_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    bias: &Tensor<F>,
    d_out: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<F>,
    scale: f32,
    softcap: f32,
    window: usize,
    #[comptime] config: AttentionConfig,
    #[define(F)] _dtype: StorageType,
) {
    let d = config.head_dim;
    let lanes = config.lanes;
    let block_k = config.block_k;
    let keys_per_lane = comptime!(block_k.div_ceil(lanes));
    let cols_per_lane = comptime!(d.div_ceil(lanes));
    let lane = UNIT_POS_X as usize;
    let row = UNIT_POS_Y as usize;

    let q_heads = q.shape(1);
    let q_len = q.shape(2);
    let kv_len = k.shape(2);
    let group = q_heads / k.shape(1);
    let kvh = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let head_base = kvh * group;
    let packed = group * q_len;
    let p0 = CUBE_POS_X as usize * config.block_q;
    let (row_valid, h, i) = packed_row(p0 + row, packed, head_base, q_len);
    let (i_lo, i_hi) = position_span(p0, cubecl::prelude::min(p0 + config.block_q, packed) - 1, q_len);
    let (start, end) = key_range(i_lo, i_hi, q_len, kv_len, window, config);

    let mut q_tile = SharedMemory::<f32>::new(comptime!(config.block_q * d));
    let mut do_tile = SharedMemory::<f32>::new(comptime!(config.block_q * d));
    let mut k_tile = SharedMemory::<f32>::new(comptime!(block_k * d));
    let mut v_tile = SharedMemory::<f32>::new(comptime!(block_k * d));
    let mut ds_tile = SharedMemory::<f32>::new(comptime!(config.block_q * block_k));
    load_packed_rows(q, &mut q_tile, b, head_base, p0, packed, config.block_q, config);
    load_packed_rows(d_out, &mut do_tile, b, head_base, p0, packed, config.block_q, config);
    let stat = (b * q_heads + h) * q_len + i;
    let mut row_lse = f32::new(EMPTY_LSE);
    let mut row_delta = 0.0f32;
    if row_valid {
        row_lse = lse[stat];
        row_delta = delta[stat];
    }

    let mut acc = Array::<f32>::new(cols_per_lane);
    #[unroll(config.unroll)]
    for c in 0..cols_per_lane {
        acc[c] = 0.0;
    }
    let mut tile = start;
    while tile < end {
        sync_cube();
        load_rows(k, &mut k_tile, b, kvh, tile, end, block_k, config);
        load_rows(v, &mut v_tile, b, kvh, tile, end, block_k, config);
        sync_cube();
        #[unroll(config.unroll)]
        for t in 0..keys_per_lane {
            let c = lane + t * lanes;
            let j = tile + c;
            if c < block_k {
                let mut ds = 0.0f32;
                if row_valid && j < end && visible(i, j, q_len, kv_len, window, config) {
                    let capped = capped_logit(row_dot(&q_tile, row, &k_tile, c, d, config.unroll), scale, softcap, config);
                    let p = (capped + bias_at(bias, b, h, i, j, config) - row_lse).exp();
                    let dp = row_dot(&do_tile, row, &v_tile, c, d, config.unroll);
                    ds = logit_grad(p, dp, row_delta, capped, softcap, config);
                }
                ds_tile[row * block_k + c] = ds;
            }
        }
        sync_cube();
        #[unroll(config.unroll)]
        for cc in 0..cols_per_lane {
            let col = lane + cc * lanes;
            if col < d {
                let mut a = acc[cc];
                for c in 0..block_k {
                    a += ds_tile[row * block_k + c] * k_tile[c * d + col];
                }
                acc[cc] = a;
            }
        }
        tile += block_k;
    }
    if row_valid {
        let base = ((b * q_heads + h) * q_len + i) * d;
        #[unroll(config.unroll)]
        for cc in 0..cols_per_lane {
            let col = lane + cc * lanes;
            if col < d {
                dq[base + col] = F::cast_from(acc[cc] * scale);
            }
        }
    }
}

/// dK and dV. Grid: x = blocks of `block_q` keys, y = kv head, z = batch. A cube's rows are keys;
/// it walks every query head of its group and the query tiles that can see its keys, so GQA
/// gradients are summed in registers, without atomics.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn backward_kv_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    bias: &Tensor<F>,
    d_out: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    scale: f32,
    softcap: f32,
    window: usize,
    #[comptime] config: AttentionConfig,
    #[define(F)] _dtype: StorageType,
) {
    let d = config.head_dim;
    let lanes = config.lanes;
    let keys = config.block_q;
    let block = config.block_k;
    let queries_per_lane = comptime!(block.div_ceil(lanes));
    let cols_per_lane = comptime!(d.div_ceil(lanes));
    let lane = UNIT_POS_X as usize;
    let key = UNIT_POS_Y as usize;

    let q_heads = q.shape(1);
    let q_len = q.shape(2);
    let kv_heads = k.shape(1);
    let kv_len = k.shape(2);
    let group = q_heads / kv_heads;
    let kvh = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let j0 = CUBE_POS_X as usize * keys;
    let j = j0 + key;
    let key_valid = j < kv_len;
    let j_last = cubecl::prelude::min(j0 + keys, kv_len) - 1;

    // Query positions that can see a key in [j0, j_last].
    let mut first = 0usize;
    let mut last = q_len;
    if comptime!(config.causal) {
        if j0 + q_len > kv_len {
            first = j0 + q_len - kv_len;
        }
    }
    if comptime!(config.window) {
        last = 0;
        if j_last + q_len + window > kv_len {
            last = cubecl::prelude::min(j_last + q_len + window - kv_len, q_len);
        }
    }

    let mut k_tile = SharedMemory::<f32>::new(comptime!(keys * d));
    let mut v_tile = SharedMemory::<f32>::new(comptime!(keys * d));
    let mut q_tile = SharedMemory::<f32>::new(comptime!(block * d));
    let mut do_tile = SharedMemory::<f32>::new(comptime!(block * d));
    let mut p_tile = SharedMemory::<f32>::new(comptime!(keys * block));
    let mut ds_tile = SharedMemory::<f32>::new(comptime!(keys * block));
    let mut lse_tile = SharedMemory::<f32>::new(block);
    let mut delta_tile = SharedMemory::<f32>::new(block);
    load_rows(k, &mut k_tile, b, kvh, j0, kv_len, keys, config);
    load_rows(v, &mut v_tile, b, kvh, j0, kv_len, keys, config);

    let mut dk_acc = Array::<f32>::new(cols_per_lane);
    let mut dv_acc = Array::<f32>::new(cols_per_lane);
    #[unroll(config.unroll)]
    for c in 0..cols_per_lane {
        dk_acc[c] = 0.0;
        dv_acc[c] = 0.0;
    }
    for g in 0..group {
        let h = kvh * group + g;
        let mut tile = first;
        while tile < last {
            sync_cube();
            load_rows(q, &mut q_tile, b, h, tile, last, block, config);
            load_rows(d_out, &mut do_tile, b, h, tile, last, block, config);
            let mut t = UNIT_POS as usize;
            while t < block {
                let mut lse_value = f32::new(EMPTY_LSE);
                let mut delta_value = 0.0f32;
                if tile + t < last {
                    let stat = (b * q_heads + h) * q_len + tile + t;
                    lse_value = lse[stat];
                    delta_value = delta[stat];
                }
                lse_tile[t] = lse_value;
                delta_tile[t] = delta_value;
                t += comptime!(config.units());
            }
            sync_cube();
            #[unroll(config.unroll)]
            for u in 0..queries_per_lane {
                let r = lane + u * lanes;
                let i = tile + r;
                if r < block {
                    let mut p = 0.0f32;
                    let mut ds = 0.0f32;
                    if key_valid && i < last && visible(i, j, q_len, kv_len, window, config) {
                        let capped = capped_logit(row_dot(&q_tile, r, &k_tile, key, d, config.unroll), scale, softcap, config);
                        p = (capped + bias_at(bias, b, h, i, j, config) - lse_tile[r]).exp();
                        let dp = row_dot(&do_tile, r, &v_tile, key, d, config.unroll);
                        ds = logit_grad(p, dp, delta_tile[r], capped, softcap, config);
                    }
                    p_tile[key * block + r] = p;
                    ds_tile[key * block + r] = ds;
                }
            }
            sync_cube();
            #[unroll(config.unroll)]
            for cc in 0..cols_per_lane {
                let col = lane + cc * lanes;
                if col < d {
                    let mut a = dv_acc[cc];
                    let mut e = dk_acc[cc];
                    for r in 0..block {
                        a += p_tile[key * block + r] * do_tile[r * d + col];
                        e += ds_tile[key * block + r] * q_tile[r * d + col];
                    }
                    dv_acc[cc] = a;
                    dk_acc[cc] = e;
                }
            }
            tile += block;
        }
    }
    if key_valid {
        let base = ((b * kv_heads + kvh) * kv_len + j) * d;
        #[unroll(config.unroll)]
        for cc in 0..cols_per_lane {
            let col = lane + cc * lanes;
            if col < d {
                dk[base + col] = F::cast_from(dk_acc[cc] * scale);
                dv[base + col] = F::cast_from(dv_acc[cc]);
            }
        }
    }
}

/// Launch `delta = Σ d_out · out` per row of the `[batch, heads, len, width]` `d_out` and `out`
/// (of `dtype`; unit-stride rows, the element strides of the first three axes given, as a
/// tensor's view of its buffer has them) into the dense f32 `delta` (`[batch, heads, len]`), all
/// bound as arrays. Rows up to 32 vectors per unit wide (far past any head size) fit; wider ones
/// are refused.
#[allow(clippy::too_many_arguments)]
pub fn launch_row_dot<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    [batch, heads, len, width]: [usize; 4],
    d_out: (ArrayArg<R>, [usize; 3]),
    out: (ArrayArg<R>, [usize; 3]),
    delta: ArrayArg<R>,
) -> Result<(), crate::row::RowTooWide> {
    let rows = batch * heads * len;
    if rows == 0 {
        return Ok(());
    }
    let mut vector_size = vector_size_for(client, width, dtype.size(), 16);
    while vector_size > 1 && d_out.1.iter().chain(&out.1).any(|s| !s.is_multiple_of(vector_size)) {
        vector_size /= 2;
    }
    let layout = RowLayout::new(client, width / vector_size, vector_size, 4)?;
    let narrow = |s: usize| u32::try_from(s / vector_size).expect("kiln::flash_attention row_dot: a stride past 32 bits of vectors");
    let strides = |[b, h, r]: [usize; 3]| VectorStridesLaunch::new(narrow(b), narrow(h), narrow(r));
    // SAFETY: every row of `d_out` and `out` lies in its array (a view's elements lie in its
    // buffer), `delta` holds `rows`; `vector_size` divides `width` and every stride, and the kernel checks rows and
    // columns against those sizes.
    unsafe {
        row_dot_kernel::launch_unchecked::<R>(
            client,
            layout.cube_count(client, rows),
            layout.cube_dim(),
            vector_size,
            d_out.0,
            out.0,
            delta,
            rows,
            width,
            heads,
            len,
            strides(d_out.1),
            strides(out.1),
            layout,
            dtype,
        )
    };
    Ok(())
}

/// Tensors of the backward: the forward's inputs, its output gradient `d_out`, its `lse` and
/// `delta = Σ d_out · out` per row (both f32 `[batch, q_heads, q_len]`); gradients contiguous.
/// With `plan.tensor_cores`, q, k, v and d_out need the forward's K/V layout (16-byte copyable
/// rows, see [`ForwardArgs`]), and lse/delta are contiguous.
pub struct BackwardArgs<R: Runtime> {
    pub q: TensorArg<R>,
    pub k: TensorArg<R>,
    pub v: TensorArg<R>,
    pub bias: TensorArg<R>,
    pub d_out: TensorArg<R>,
    pub lse: TensorArg<R>,
    pub delta: TensorArg<R>,
}

/// Width of the f32 vectors the tensor-core backward adds into dQ atomically: 4 where the
/// runtime offers 4-wide f32 atomic adds (CUDA sm_90), else 1 (`KILN_ATTENTION_DQ_VECTOR=1`
/// forces scalar adds, for measurements).
fn dq_vector_size<R: Runtime>(client: &ComputeClient<R>) -> usize {
    let f32_atomic = Type::new(StorageType::Atomic(ElemType::Float(FloatKind::F32)));
    let wide = client.properties().atomic_type_usage(f32_atomic.with_vector_size(4)).contains(AtomicUsage::Add);
    if wide && measurement_override("KILN_ATTENTION_DQ_VECTOR", 1..=1).is_none() { 4 } else { 1 }
}

/// Launch the backward: dQ into `dq`, dK and dV into `dk`, `dv`. With `plan.tensor_cores` one
/// kernel computes all three, and `dq` must be a zeroed, contiguous f32 accumulator shaped like
/// `q` that receives the final dQ (the caller casts it to the input dtype); the portable kernels
/// write `dq` in `dtype`, from a dQ kernel and a dK/dV kernel (which is why the argument set comes
/// twice: both bind the same inputs).
#[allow(clippy::too_many_arguments)]
pub fn launch_backward<R: Runtime>(
    client: &ComputeClient<R>,
    plan: &AttentionPlan,
    shape: AttentionShape,
    features: AttentionFeatures,
    scale: f32,
    dtype: StorageType,
    for_dq: BackwardArgs<R>,
    for_dkv: BackwardArgs<R>,
    dq: TensorArg<R>,
    dk: TensorArg<R>,
    dv: TensorArg<R>,
) {
    let config = plan.config;
    let group = shape.q_heads / shape.kv_heads;
    if plan.tensor_cores {
        let keys = plan.backward_planes * mma::PLANE_ROWS;
        // SAFETY: as for the tensor-core forward; Q, K, V and dO rows are 16-byte copyable
        // (see `BackwardArgs`), `dq` the f32 accumulator and `dk`/`dv` contiguous, all shaped
        // like their inputs.
        unsafe {
            mma::backward::mma_backward_kernel::launch_unchecked::<R>(
                client,
                grid(shape, keys, shape.kv_len, 1),
                CubeDim::new_2d(32, plan.backward_planes as u32),
                dq_vector_size(client),
                for_dkv.q,
                for_dkv.k,
                for_dkv.v,
                for_dkv.bias,
                for_dkv.d_out,
                for_dkv.lse,
                for_dkv.delta,
                dq,
                dk,
                dv,
                scale,
                features.softcap.unwrap_or(1.0),
                features.window.unwrap_or(0),
                config,
                plan.backward_planes,
                mma::backward::dq_columns(shape.head_dim),
                dtype,
            );
        }
        return;
    }
    // The dK/dV kernel's rows are keys (`block_q` of them) and its tiles queries (`block_k`).
    let kv_config = AttentionConfig { block_q: BLOCK_ROWS, block_k: config.block_k.min(32), ..config };
    // SAFETY: as for the forward; gradients are contiguous and shaped like their inputs.
    unsafe {
        backward_q_kernel::launch_unchecked::<R>(
            client,
            grid(shape, config.block_q, group * shape.q_len, 1),
            cube_dim(config),
            for_dq.q,
            for_dq.k,
            for_dq.v,
            for_dq.bias,
            for_dq.d_out,
            for_dq.lse,
            for_dq.delta,
            dq,
            scale,
            features.softcap.unwrap_or(1.0),
            features.window.unwrap_or(0),
            config,
            dtype,
        );
        backward_kv_kernel::launch_unchecked::<R>(
            client,
            grid(shape, kv_config.block_q, shape.kv_len, 1),
            cube_dim(kv_config),
            for_dkv.q,
            for_dkv.k,
            for_dkv.v,
            for_dkv.bias,
            for_dkv.d_out,
            for_dkv.lse,
            for_dkv.delta,
            dk,
            dv,
            scale,
            features.softcap.unwrap_or(1.0),
            features.window.unwrap_or(0),
            kv_config,
            dtype,
        );
    }
}
