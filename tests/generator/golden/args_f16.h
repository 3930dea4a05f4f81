// @generated from templates/_args.h.j2 for family f16: the runtime's argument struct
// (rdnattention/families/f16.py), layout digest d60ba9bce60c1936.
#pragma once

struct Fa2Args {
  const half_t* q;
  const half_t* k;
  const half_t* v;
  half_t* o;
  long long q_stride_b;
  long long q_stride_h;
  long long q_stride_s;
  long long k_stride_b;
  long long k_stride_h;
  long long k_stride_s;
  long long v_stride_b;
  long long v_stride_h;
  long long v_stride_s;
  long long o_stride_b;
  long long o_stride_h;
  long long o_stride_s;
  int batch;
  int heads_q;
  int heads_kv;
  int seq_q;
  int seq_k;
  int window_left;
  int window_right;
  float scale_log2;
  float* lse;
  long long lse_stride_b;
  long long lse_stride_h;
  const int* seqused_k;
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  const float* rotary_cos;
  const float* rotary_sin;
  long long rotary_stride;
  int rotary_dim;
  int rotary_interleaved;
  int heavy_first;
  int total_q;
  int total_k;
  float softcap_log2;
  float softcap_inv;
  const float* alibi_slopes;
  long long alibi_stride_b;
  const float* sinks;
};
