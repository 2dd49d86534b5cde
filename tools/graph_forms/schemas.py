"""Print schema + dispatch kind of the ops named in the families (for rule authors)."""
import torch
aten = torch.ops.aten
ops = [aten.batch_norm.default, aten._native_batch_norm_legit_no_training.default,
       aten._native_batch_norm_legit_functional.default, aten._native_batch_norm_legit.default,
       aten.rrelu.default, aten.rrelu_with_noise.default, aten.rrelu_with_noise_functional.default,
       aten.dropout.default, aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten.reshape.default,
       aten.lift_fresh_copy.default, aten.detach_.default, aten._assert_tensor_metadata.default,
       aten.max_pool2d.default, aten.max_pool2d_with_indices.default, aten.max_pool1d.default,
       aten.avg_pool1d.default, aten.avg_pool2d.default, aten.avg_pool3d.default, aten.max_pool1d_with_indices.default,
       aten.max_pool3d_with_indices.default, aten.index.Tensor, aten.index_put_.default, aten.pow.Tensor_Scalar,
       aten.mul.Tensor, aten._assert_scalar.default, aten.sym_constrain_range_for_size.default, aten.masked_select.default]
cia = torch._C.DispatchKey.CompositeImplicitAutograd
for op in ops:
    core = torch.Tag.core in op.tags
    print(f"{str(op):55s} CIA={torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), cia)!s:5s} core={core!s:5s}\n    {op._schema}")
