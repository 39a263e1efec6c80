import jax


# Strict promotion catches silent dtype changes that a wrapper could introduce.
jax.config.update("jax_numpy_dtype_promotion", "strict")
