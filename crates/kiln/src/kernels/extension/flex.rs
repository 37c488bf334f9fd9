//! The kernels on Burn's `flex` backend: each operation of [`super::KilnKernels`] reads its
//! operands' host values, runs the slice kernel from `kiln-kernels` and wraps the result.

use super::*;
use kiln_kernels::depthwise::planar;

impl KilnKernels for Flex {
    fn kiln_conv2d(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        let Some(s) = conv_shape(&x, &weight, &options).filter(|_| bias.dtype() == DType::F32)
        else {
            return Flex::conv2d(x, weight, Some(bias), options);
        };
        let out = if options.groups > 1 {
            // Depthwise (`conv_shape` admits no other grouping).
            planar::forward(&s, &values(&x), &values(&weight), Some(&values(&bias)))
        } else {
            conv2d_forward_new(&s, &values(&x), &values(&weight), Some(&values(&bias)))
        };
        flex_tensor(out, [s.batch, s.cout, s.out_h(), s.out_w()])
    }

    fn kiln_conv2d_x_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        let Some(s) =
            conv_shape(&x, &weight, &options).filter(|_| output_grad.dtype() == DType::F32)
        else {
            return Flex::conv2d_x_backward(x, weight, output_grad, options);
        };
        let _op = tracing::trace_span!(
            "kiln.conv2d.grad_input",
            batch = s.batch,
            cin = s.cin,
            cout = s.cout
        )
        .entered();
        let dx = if options.groups > 1 {
            planar::input_grad(&s, &values(&output_grad), &values(&weight))
        } else {
            conv2d_input_grad_new(&s, &values(&output_grad), &values(&weight))
        };
        flex_tensor(dx, [s.batch, s.cin, s.h, s.w])
    }

    fn kiln_conv2d_weight_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        let Some(s) =
            conv_shape(&x, &weight, &options).filter(|_| output_grad.dtype() == DType::F32)
        else {
            return Flex::conv2d_weight_backward(x, weight, output_grad, options);
        };
        let _op = tracing::trace_span!(
            "kiln.conv2d.grad_weight",
            batch = s.batch,
            cin = s.cin,
            cout = s.cout
        )
        .entered();
        if options.groups > 1 {
            let dw = planar::weight_grad(&s, &values(&x), &values(&output_grad));
            return flex_tensor(dw, [s.cout, 1, s.kh, s.kw]);
        }
        let mut dw = vec![0f32; s.weight_len()];
        conv2d_weight_grad(&s, &values(&x), &values(&output_grad), &mut dw);
        flex_tensor(dw, [s.cout, s.cin, s.kh, s.kw])
    }

    fn kiln_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let shapes = f32_matrices(&x, &weight, (1, 0)).filter(|_| bias.dtype() == DType::F32);
        let Some(([rows, inputs], [_, outputs])) = shapes else {
            return linear_by_ops::forward::<Flex>(x, weight, bias);
        };
        let s = LinearShape {
            rows,
            inputs,
            outputs,
        };
        let y = linear_forward(&s, &values(&x), &values(&weight), Some(&values(&bias)));
        flex_tensor(y, [s.rows, s.outputs])
    }

    fn kiln_linear_x_backward(
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let Some(([inputs, outputs], [rows, _])) = f32_matrices(&weight, &output_grad, (1, 1))
        else {
            return linear_by_ops::x_backward::<Flex>(weight, output_grad);
        };
        let s = LinearShape {
            rows,
            inputs,
            outputs,
        };
        let _op =
            tracing::trace_span!("kiln.linear.grad_input", s.rows, s.inputs, s.outputs).entered();
        let dx = linear_input_grad(&s, &values(&output_grad), &values(&weight));
        flex_tensor(dx, [s.rows, s.inputs])
    }

    fn kiln_linear_weight_backward(
        x: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let Some(([rows, inputs], [_, outputs])) = f32_matrices(&x, &output_grad, (0, 0)) else {
            return linear_by_ops::weight_backward::<Flex>(x, output_grad);
        };
        let s = LinearShape {
            rows,
            inputs,
            outputs,
        };
        let _op =
            tracing::trace_span!("kiln.linear.grad_weight", s.rows, s.inputs, s.outputs).entered();
        let dw = linear_weight_grad(&s, &values(&x), &values(&output_grad));
        flex_tensor(dw, [s.inputs, s.outputs])
    }

    fn kiln_max_pool2d(
        x: FloatTensor<Self>,
        kernel: [usize; 2],
        stride: [usize; 2],
    ) -> FloatTensor<Self> {
        let Some(s) = pool_shape(&x, kernel, stride) else {
            return Flex::max_pool2d(x, kernel, stride, [0, 0], [1, 1], false);
        };
        let dims = x.shape();
        let mut out = vec![0f32; s.planes * s.out_h() * s.out_w()];
        max_pool2d_forward(&s, &values(&x), &mut out, None);
        flex_tensor(out, [dims[0], dims[1], s.out_h(), s.out_w()])
    }

    fn kiln_max_pool2d_with_indices(
        x: FloatTensor<Self>,
        kernel: [usize; 2],
        stride: [usize; 2],
    ) -> (FloatTensor<Self>, IntTensor<Self>) {
        let Some(s) = pool_shape(&x, kernel, stride) else {
            let r = Flex::max_pool2d_with_indices(
                x,
                kernel,
                stride,
                [0, 0],
                [1, 1],
                false,
                IntDType::I64,
            );
            return (r.output, r.indices);
        };
        let dims = x.shape();
        let shape = [dims[0], dims[1], s.out_h(), s.out_w()];
        let mut out = vec![0f32; s.planes * s.out_h() * s.out_w()];
        let mut indices = vec![0i64; out.len()];
        max_pool2d_forward(&s, &values(&x), &mut out, Some(&mut indices));
        let indices = <IntTensor<Flex>>::from_data(TensorData::new(indices, shape));
        (flex_tensor(out, shape), indices)
    }

    fn kiln_max_pool2d_backward(
        x: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
        kernel: [usize; 2],
        stride: [usize; 2],
    ) -> FloatTensor<Self> {
        let s = pool_shape(&x, kernel, stride)
            .filter(|_| output_grad.dtype() == DType::F32 && indices.dtype() == DType::I64);
        let Some(s) = s else {
            return Flex::max_pool2d_with_indices_backward(
                x,
                kernel,
                stride,
                [0, 0],
                [1, 1],
                false,
                output_grad,
                indices,
            )
            .x_grad;
        };
        let _op = tracing::trace_span!("kiln.max_pool2d.grad_input", planes = s.planes).entered();
        let dims = x.shape();
        let idx = indices.to_contiguous();
        let idx = idx.as_slice::<i64>().unwrap_or(&[]);
        let mut dx = vec![0f32; s.planes * s.h * s.w];
        max_pool2d_backward(&s, &values(&output_grad), idx, &mut dx);
        flex_tensor(dx, [dims[0], dims[1], s.h, s.w])
    }

    fn kiln_global_avg_pool2d(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let d = x.shape();
        if x.dtype() != DType::F32 || d.num_dims() != 4 || d[2] * d[3] == 0 {
            return global_avg_pool_by_ops::<Flex>(x);
        }
        let _op = tracing::trace_span!("kiln.global_avg_pool2d", input = ?d).entered();
        let y = global_avg_pool_nchw(&values(&x), d[2] * d[3]);
        flex_tensor(y, [d[0], d[1]])
    }

    fn kiln_global_avg_pool2d_backward(
        output_grad: FloatTensor<Self>,
        dims: [usize; 4],
    ) -> FloatTensor<Self> {
        if output_grad.dtype() != DType::F32 || dims[2] * dims[3] == 0 {
            return global_avg_pool_backward_by_ops::<Flex>(output_grad, dims);
        }
        let _op =
            tracing::trace_span!("kiln.global_avg_pool2d.grad_input", input = ?dims).entered();
        let dx = global_avg_pool_nchw_backward(&values(&output_grad), dims[2] * dims[3]);
        flex_tensor(dx, dims)
    }

    fn kiln_adam(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moment_1: FloatTensor<Self>,
        moment_2: FloatTensor<Self>,
        time: FloatTensor<Self>,
        apply: FloatTensor<Self>,
        factor: FloatTensor<Self>,
        config: [f32; 5],
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let _op =
            tracing::trace_span!("kiln.adam", elements = param.shape().num_elements()).entered();
        // The step's scalars are this kernel's inputs on its own device (flex runs on the
        // host): reading them is the kernel reading its operands, not a device sync.
        let first = |t: &FloatTensor<Self>| values(t).first().copied().unwrap_or(f32::NAN);
        if first(&apply) == 0.0 {
            // A skipped step: parameter and moments stay as they were.
            return (param, moment_1, moment_2);
        }
        let step = AdamConfigScalars::from_array(config).step(first(&time) as i32);
        let grad = values(&grad);
        // Clipping's coefficient; exactly 1 when the norm is under the threshold.
        let grad = match first(&factor) {
            1.0 => grad,
            f => std::borrow::Cow::Owned(grad.iter().map(|g| g * f).collect()),
        };
        // In place: the optimizer hands over tensors it alone holds, so `storage_mut` writes
        // into their buffers (it copies one that is shared: the first step's zero moments).
        let [mut p, mut m, mut v] = [param, moment_1, moment_2].map(dense);
        adam_update(
            &step,
            p.storage_mut::<f32>(),
            &grad,
            [m.storage_mut::<f32>(), v.storage_mut::<f32>()],
        );
        (p, m, v)
    }

    // The BatchNorm kernels take f32 NCHW only; `kernels::batch_norm` routes nothing else
    // here, so another input is a caller's bug, reported as such.
    fn kiln_batch_norm_stats(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let s = norm_shape(&x).expect("kiln_batch_norm_stats takes f32 NCHW input");
        let _op =
            tracing::trace_span!("kiln.batch_norm.stats", s.batch, s.channels, s.plane).entered();
        let (mean, var) = batch_norm_stats(&s, &values(&x));
        flex_tensor([mean, var].concat(), [2, s.channels])
    }

    fn kiln_batch_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
    ) -> FloatTensor<Self> {
        let s = norm_shape(&x).expect("kiln_batch_norm takes f32 NCHW input");
        let out = with_norm_params(&gamma, &beta, &stats, epsilon, relu, |p| {
            batch_norm_forward_new(&s, &values(&x), p)
        });
        let d = x.shape();
        flex_tensor(out, [d[0], d[1], d[2], d[3]])
    }

    fn kiln_batch_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
        output_grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let s = norm_shape(&x).expect("kiln_batch_norm_backward takes f32 NCHW input");
        let _op =
            tracing::trace_span!("kiln.batch_norm.grad", s.batch, s.channels, s.plane).entered();
        let (dx, dgamma, dbeta) = with_norm_params(&gamma, &beta, &stats, epsilon, relu, |p| {
            batch_norm_backward_new(&s, &values(&x), p, &values(&output_grad))
        });
        let d = x.shape();
        (
            flex_tensor(dx, [d[0], d[1], d[2], d[3]]),
            flex_tensor(dgamma, [s.channels]),
            flex_tensor(dbeta, [s.channels]),
        )
    }

    fn kiln_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        transformer_flex::layer_norm(x, gamma, beta, epsilon)
    }

    fn kiln_layer_norm_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        transformer_flex::layer_norm_train_forward(x, gamma, beta, epsilon)
    }

    fn kiln_layer_norm_backward(
        x: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        transformer_flex::layer_norm_grads(x, stats, gamma, output_grad)
    }

    fn kiln_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        transformer_flex::gelu(x)
    }

    fn kiln_gelu_backward(
        x: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        transformer_flex::gelu_grad(x, output_grad)
    }

    fn kiln_relu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        transformer_flex::relu(x)
    }

    fn kiln_relu_backward(
        output: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        transformer_flex::relu_grad(output, output_grad)
    }

    fn kiln_softmax(x: FloatTensor<Self>) -> FloatTensor<Self> {
        transformer_flex::softmax(x)
    }

    fn kiln_softmax_backward(
        output: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        transformer_flex::softmax_grad(output, output_grad)
    }

    fn kiln_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> FloatTensor<Self> {
        let operands = [query, key, value];
        attention_flex::attention(operands, (mask, bias), (scale, causal, false)).0
    }

    fn kiln_attention_train(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        scale: f64,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let operands = [query, key, value];
        attention_flex::attention(operands, (mask, bias), (scale, causal, true))
    }

    fn kiln_attention_backward(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        scale: f64,
        bias_grad: bool,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
    ) {
        let operands = [query, key, value];
        attention_flex::attention_grads(operands, probs, output_grad, (scale, bias_grad))
    }

    fn kiln_qkv_attention(
        qkv: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        causal: bool,
    ) -> FloatTensor<Self> {
        attention_flex::qkv_attention(qkv, (mask, bias), heads, (scale, causal, false)).0
    }

    fn kiln_qkv_attention_train(
        qkv: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        attention_flex::qkv_attention(qkv, (mask, bias), heads, (scale, causal, true))
    }

    fn kiln_qkv_attention_backward(
        qkv: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        bias_grad: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        attention_flex::qkv_attention_grads(qkv, probs, output_grad, heads, (scale, bias_grad))
    }
}
