//! Convolutions on host images: dense, grouped and depthwise layers with weights packed on
//! first use (NCHW input planes read in place where they fit), the fused 1×1 + depthwise
//! pair, channel Concat written in place, int8 convolutions, and the 2×2 pool fused into a
//! convolution's output.

use super::*;

/// A 1×1 convolution `pw` and the depthwise convolution `dw` that alone reads its output
/// (fused at load, `fuse_expand_depthwises`), in one pass over bands of rows
/// ([`kiln_kernels::expand_depthwise`]): the expanded image never reaches memory. `split`:
/// how many of `ins` are `pw`'s (the rest are `dw`'s after its first). `None` (inputs
/// untouched) where that kernel does not take them: the caller runs the two layers apart.
pub(in crate::onnx) fn expand_depthwise(
    pw: &HostStep,
    dw: &HostStep,
    ins: &mut [Option<Slot>],
    split: usize,
) -> Option<Result<Vec<Slot>, OnnxError>> {
    let Some(Some(Slot::Image(x))) = ins.first() else {
        return None;
    };
    let (Node::Conv2d(pn), Node::Conv2d(dn)) = (pw.node, dw.node) else {
        return None;
    };
    let Some(Packed::Conv(PackedConv::Dense(pointwise))) = pw
        .cache
        .get_or_init(|| pack_conv(pw, &ins[..split], pn.config.groups).map(Packed::Conv))
    else {
        return None;
    };
    let Some(Packed::Conv(PackedConv::Depthwise(depthwise))) = dw.cache.get_or_init(|| {
        // The depthwise layer's inputs as it numbers them: its first (the 1×1's output)
        // is not a constant and packing does not read it.
        let ins: Vec<Option<Slot>> = std::iter::once(None)
            .chain(ins[split..].iter().cloned())
            .collect();
        pack_conv(dw, &ins, dn.config.groups).map(Packed::Conv)
    }) else {
        return None;
    };
    let [expanded, cin, ..] = pointwise.dims();
    let window = node_window(dw.node).ok()?;
    if x.dims[3] != cin || depthwise.channels() != expanded {
        return None;
    }
    let [n, h, w, _] = x.dims;
    let (win, out_dims) = match conv_window(
        [n, h, w, expanded],
        (expanded, depthwise.kernel(), expanded),
        &window,
    ) {
        Ok(fit) => fit,
        Err(e) => return Some(Err(e)),
    };
    let _op = tracing::trace_span!("kiln.expand_depthwise", input = ?x.dims, expanded).entered();
    let layers = ExpandDepthwise {
        pointwise,
        pointwise_act: pw.act,
        depthwise,
        depthwise_act: dw.act,
    };
    let out = kiln_kernels::expand_depthwise::expand_depthwise(&x.data, &win, &layers)?;
    // The input's last reader is done with it.
    take(ins, 0);
    Some(Ok(vec![Slot::Image(Image::new(out, out_dims))]))
}

/// Convolutions `layers` (their inputs `counts[i]` of `ins` each, in turn) and the channel
/// Concat of their outputs (fused at load, `fuse_concat_convs`): each writes its channels of
/// the concatenated image in place, so the Concat copies nothing. `None` (inputs untouched)
/// where that path does not take them: the caller runs the layers and the Concat.
pub(in crate::onnx) fn concat_convs(
    layers: &[HostStep],
    counts: &[usize],
    ins: &mut [Option<Slot>],
) -> Option<Result<Vec<Slot>, OnnxError>> {
    let mut plans = Vec::with_capacity(layers.len());
    // Where each layer's image input is in `ins`, taken once all have run.
    let mut inputs = Vec::with_capacity(layers.len());
    let (mut first, mut channels, mut pixels) = (0, 0, None);
    for (layer, &count) in layers.iter().zip(counts) {
        let Some(Some(Slot::Image(x))) = ins.get(first) else {
            return None;
        };
        let Node::Conv2d(n) = layer.node else {
            return None;
        };
        let window = node_window(layer.node).ok()?;
        let mine = &ins[first..first + count];
        let Some(Packed::Conv(PackedConv::Dense(weights))) = layer
            .cache
            .get_or_init(|| pack_conv(layer, mine, n.config.groups).map(Packed::Conv))
        else {
            return None;
        };
        // A shape error is the layer's own to report, run apart.
        let (win, [n, oh, ow, cout]) = conv_window(x.dims, dense_io(weights), &window).ok()?;
        if weights.kernel().panel_width().is_none() || pixels.is_some_and(|p| p != [n, oh, ow]) {
            return None;
        }
        pixels = Some([n, oh, ow]);
        plans.push((&x.data[..], dense_shape(&win, cout), weights, layer.act));
        inputs.push(first);
        channels += cout;
        first += count;
    }
    let [n, oh, ow] = pixels?;
    let _op = tracing::trace_span!("kiln.concat_convs", output = ?[n, oh, ow, channels]).entered();
    let out = kiln_kernels::base::buffers::filled(n * oh * ow * channels, |out| {
        let mut offset = 0;
        for (x, shape, weights, act) in &plans {
            // Every layer's kernel was checked above: each writes its channels.
            conv2d_nhwc_into_channels(shape, x, weights, *act, (out, channels, offset));
            offset += shape.cout;
        }
    });
    drop(plans);
    for at in inputs {
        take(ins, at);
    }
    Some(Ok(vec![Slot::Image(Image::new(
        out,
        [n, oh, ow, channels],
    ))]))
}

/// An int8 convolution (the int8 pass's) of an image, its output left channels-last;
/// then the fused residual (input `residual`) and activation, which the pass leaves outside the
/// integer epilogue when there is a residual.
pub(in crate::onnx) fn int8_conv(
    q: &crate::onnx::passes::QConv,
    ins: &mut [Option<Slot>],
    (residual, act): (Option<usize>, Option<Activation>),
    device: &Device,
) -> Option<Result<Vec<Slot>, OnnxError>> {
    let x = take(ins, 0)?;
    let residual = residual.and_then(|i| take(ins, i));
    let run = || -> Result<Vec<Slot>, OnnxError> {
        // An NCHW input (the graph's) is made channels-last once; the layers after stay so.
        let x = x.into_image()?;
        let _op = tracing::trace_span!("kiln.qconv_nhwc", input = ?x.dims).entered();
        let (y, dims) = q.run_nhwc(&x.data, x.dims)?;
        let y = Image::new(y, dims);
        match residual {
            Some(r) => add_residual(y, r, act, device),
            None => match act {
                Some(act) => Ok(vec![activate_slot(Slot::Image(y), act)?]),
                None => Ok(vec![Slot::Image(y)]),
            },
        }
    };
    Some(run())
}

/// Packs the weights of Conv step `step` when they are constants and the grouping is one the
/// host kernels run (one group, depthwise with one filter per channel, or groups the
/// implicit GEMM's panels hold).
pub(super) fn pack_conv(
    step: &HostStep,
    ins: &[Option<Slot>],
    groups: usize,
) -> Option<PackedConv> {
    if !(step.constant)(1) {
        return None;
    }
    let (weight, dims) = float_constant(ins, 1)?;
    let [cout, per_group, kh, kw]: [usize; 4] = dims.try_into().ok()?;
    let bias = optional_constant(step, ins, 2, cout)?;
    if groups == 1 {
        let weights = ConvWeights::pack([cout, per_group, kh, kw], &weight, bias.as_deref());
        return Some(PackedConv::Dense(if step.winograd {
            weights
        } else {
            weights.without_winograd()
        }));
    }
    if per_group == 1 && groups == cout {
        return Some(PackedConv::Depthwise(DepthwiseWeights::pack(
            cout,
            [kh, kw],
            &weight,
            bias.as_deref(),
        )));
    }
    ConvWeights::pack_grouped([cout, per_group, kh, kw], groups, &weight, bias.as_deref())
        .map(PackedConv::Dense)
}

/// The convolution of `x` (an image, or an NCHW value converted once), plus `residual`
/// when given (in the kernel's store when it has the output's shape), then `act`.
pub(super) fn conv(
    x: Slot,
    packed: &PackedConv,
    window: &Window,
    (act, residual): (Option<Activation>, Option<Slot>),
    pool: bool,
    device: &Device,
) -> Result<Vec<Slot>, OnnxError> {
    let x = match (x, packed) {
        (Slot::Value(v), PackedConv::Dense(weights))
            if residual.is_none() && !pool && reads_as_planes(&v, weights) =>
        {
            return conv_planes(v, weights, window, act);
        }
        (x, _) => x,
    };
    let image = x.into_image()?;
    let (win, out_dims) = conv_window(image.dims, packed.io(image.dims[3]), window)?;
    let [n, oh, ow, cout] = out_dims;
    // A residual of the output's shape goes into the store; another (a broadcast operand) is
    // added after, and the ReLU waits for it.
    let (in_store, after) = match residual {
        None => (None, None),
        Some(Slot::Image(r)) if r.dims == out_dims => (Some(r), None),
        Some(Slot::Value(v)) if v.kind() == ValueKind::Float && v.dims() == [n, cout, oh, ow] => {
            (Some(Image::from_value(v)?), None)
        }
        Some(other) => (None, Some(other)),
    };
    // With a residual added after the store, the activation waits for it.
    let act_now = act.filter(|_| after.is_none());
    let out = match packed {
        PackedConv::Dense(weights) => {
            let s = dense_shape(&win, cout);
            let _op = tracing::trace_span!("kiln.conv2d_nhwc", input = ?image.dims, cout).entered();
            if pool && in_store.is_none() && act_now == Some(Activation::Relu) {
                // The pooled maximum is what the kernel stores (`fuse_relu_pools`).
                let out = conv2d_nhwc_relu_pool2_new(&s, &image.data, weights);
                let pooled = Image::new(out, [n, oh / 2, ow / 2, cout]);
                return Ok(vec![Slot::Image(pooled)]);
            }
            let apart =
                |r: Option<&[f32]>| conv2d_nhwc_fused_new(&s, &image.data, weights, r, act_now);
            match in_store {
                // The residual's last reader writes the sum over its buffer.
                Some(r) => owned_or_shared(
                    r.data,
                    |r| conv2d_nhwc_fused_onto(&s, &image.data, weights, r, act_now),
                    |r| apart(Some(r)),
                ),
                None => apart(None),
            }
        }
        PackedConv::Depthwise(weights) => {
            let _op = tracing::trace_span!("kiln.depthwise_nhwc", input = ?image.dims).entered();
            match &in_store {
                None => depthwise_conv2d(&image.data, &win, weights, act_now),
                Some(r) => {
                    let mut out = depthwise_conv2d(&image.data, &win, weights, None);
                    arith_in_place(&mut out, &r.data, Arith::Add, false);
                    if let Some(act) = act_now {
                        activate(&mut out, act);
                    }
                    out
                }
            }
        }
    };
    let out = Image::new(out, out_dims);
    let outs = match after {
        Some(r) => add_residual(out, r, act, device),
        None => Ok(vec![Slot::Image(out)]),
    };
    if pool {
        outs.and_then(max_pool_2x2)
    } else {
        outs
    }
}

/// The 2×2, stride-2 max pool fused into a convolution at load, over its first output,
/// where its kernel did not pool in its store (a depthwise or int8 convolution).
pub(in crate::onnx) fn max_pool_2x2(mut outs: Vec<Slot>) -> Result<Vec<Slot>, OnnxError> {
    if outs.is_empty() {
        return Ok(outs);
    }
    let image = outs.remove(0).into_image()?;
    let win = Window2d {
        dims: image.dims,
        kernel: [2, 2],
        stride: [2, 2],
        dilation: [1, 1],
        pads: [(0, 0); 2],
        ceil_mode: false,
    };
    let pooled = pool2d(&image.data, &win, PoolKind::Max);
    outs.insert(0, Slot::Image(Image::new(pooled, win.out_dims())));
    Ok(outs)
}

impl PackedConv {
    /// Input channels, kernel size and output channels (of an input of `c` channels).
    fn io(&self, c: usize) -> (usize, [usize; 2], usize) {
        match self {
            PackedConv::Dense(weights) => dense_io(weights),
            PackedConv::Depthwise(weights) => (weights.channels(), weights.kernel(), c),
        }
    }
}

/// [`PackedConv::io`] of a dense convolution.
pub(super) fn dense_io(weights: &ConvWeights) -> (usize, [usize; 2], usize) {
    let [cout, _, kh, kw] = weights.dims();
    (weights.input_channels(), [kh, kw], cout)
}

/// The window of a convolution (`io` from [`PackedConv::io`]) over an image of dimensions
/// `[n, h, w, c]`, and the output's dimensions; an error when the channels or the size do
/// not fit the kernel.
pub(super) fn conv_window(
    [n, h, w, c]: [usize; 4],
    (cin, kernel, cout): (usize, [usize; 2], usize),
    window: &Window,
) -> Result<(Window2d, [usize; 4]), OnnxError> {
    let pads = window.pads([h, w]);
    if c != cin {
        return Err(OnnxError::Shape(format!(
            "Conv expects {cin} input channels; the input has {c}"
        )));
    }
    kernel_fits([h, w], pads, kernel, window.dilation)?;
    let win = Window2d {
        dims: [n, h, w, c],
        kernel,
        stride: window.stride,
        dilation: window.dilation,
        pads,
        ceil_mode: false,
    };
    let [_, oh, ow, _] = win.out_dims();
    Ok((win, [n, oh, ow, cout]))
}

/// The dense convolution of `cout` outputs over `win`.
pub(super) fn dense_shape(win: &Window2d, cout: usize) -> ConvShape {
    let [batch, h, w, cin] = win.dims;
    ConvShape {
        batch,
        cin,
        h,
        w,
        cout,
        kh: win.kernel[0],
        kw: win.kernel[1],
        stride: win.stride,
        padding: win.pads,
        dilation: win.dilation,
    }
}

/// Input channels up to which a dense convolution reads an NCHW value as it is (see
/// [`conv2d_nhwc_fused_from_nchw_new`]): an RGB or RGBA image, whose pixels gather from
/// that many planes at once. Wider NCHW values go through the blocked transpose.
pub(super) const PLANE_CHANNELS: usize = 4;

/// Whether `v` is an NCHW float image of few channels that a dense convolution of `weights`
/// reads without a transpose first (a graph's input into its stem).
pub(super) fn reads_as_planes(v: &Value, weights: &ConvWeights) -> bool {
    let dims = v.dims();
    v.kind() == ValueKind::Float
        && dims.len() == 4
        && dims[1] == weights.input_channels()
        && dims[1] <= PLANE_CHANNELS
        && dims[2] * dims[3] > 1
}

/// The dense convolution (then `act`) of an NCHW image `v`, read in place where the backend
/// allows: the kernel transposes it while padding ([`reads_as_planes`]).
pub(super) fn conv_planes(
    v: Value,
    weights: &ConvWeights,
    window: &Window,
    act: Option<Activation>,
) -> Result<Vec<Slot>, OnnxError> {
    let Ok([n, c, h, w]) = <[usize; 4]>::try_from(v.dims()) else {
        return Err(OnnxError::Shape(format!(
            "an image layer takes [N, C, H, W]; got {:?}",
            v.dims()
        )));
    };
    let (win, out_dims) = conv_window([n, h, w, c], dense_io(weights), window)?;
    let s = dense_shape(&win, out_dims[3]);
    let _op =
        tracing::trace_span!("kiln.conv2d_nhwc", input = ?[n, c, h, w], layout = "nchw").entered();
    let out = v.with_f32s(|x| conv2d_nhwc_fused_from_nchw_new(&s, x, weights, act))?;
    Ok(vec![Slot::Image(Image::new(out, out_dims))])
}

/// Refuses a convolution whose (dilated) kernel is larger than its padded `[h, w]` input:
/// it would have no output.
pub(in crate::onnx) fn kernel_fits(
    [h, w]: [usize; 2],
    pads: [(usize, usize); 2],
    kernel: [usize; 2],
    dilation: [usize; 2],
) -> Result<(), OnnxError> {
    for (axis, len) in [h, w].into_iter().enumerate() {
        let span = (kernel[axis].max(1) - 1) * dilation[axis] + 1;
        let padded = len + pads[axis].0 + pads[axis].1;
        if padded < span {
            return Err(OnnxError::Shape(format!(
                "Conv input {h}×{w} (padded {padded} on axis {axis}) is smaller than its \
                 {kernel:?} kernel (dilation {dilation:?})"
            )));
        }
    }
    Ok(())
}
