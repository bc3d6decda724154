/* What the pca stage's two directions share (pca.c, pca_decode.c): the rotation of keys by their positions. */
#ifndef KVN_PCA_IMPL_H
#define KVN_PCA_IMPL_H
#include "floats.h"
#include "pca.h"

/* float32 cos and sin of position * frequency for each channel pair, as the reference's `rotation`. */
void kvn_pca_rotation(const kvn_pca_model *m, uint64_t position, float *cos_out, float *sin_out);
/* Each head's channel pairs of one token's values turned by minus (back) or plus their angles, in float32. */
void kvn_pca_rotate(const kvn_pca_model *m, float *x, const float *cs, const float *sn, int back);

#endif
