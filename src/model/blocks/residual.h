// ResidualScheme: how a model's layers are joined, owned by the model. The scheme keeps the residual
// streams of a step ([T, W], W = N * H for N streams of width H) and maps them to and from the
// sites: a site is one sublayer (layer i's mixer is site 2i, its feed-forward site 2i + 1), which
// reads its input x [T, H] from the streams (the site's pre map, e.g. a norm, or a hyper-connection's
// weighted collapse) and hands its output back (the post map, e.g. a residual add, or a per-stream
// injection). Stream blocks (layer.h) act on the streams between sites. At the end the scheme
// collapses the streams into the final hidden state [T, H] the LM head reads.
//
// A step runs, with x and out [T, H] buffers owned by the caller:
//   s = allocate(step); write the stack's input rows into s.input; begin(step, s);
//   pre(0, x); site 0 (x -> out); post_pre(0, out, x); site 1; post_pre(1, out, x); ...;
//   post_finish(last, out, hidden)
// with post(k) ... stream blocks ... pre(k + 1) instead of post_pre(k) where stream blocks sit
// between the two sites. post_pre and post_finish exist so that a scheme can fuse the two maps
// (the pre-norm residual's add + norm kernel); their defaults run the two halves.
//
// A scheme's methods are const: its per-step memory (streams, state a site's pre map leaves for its
// post map) lives in the ResidualStreams that allocate() makes from the step's workspace, before any
// layer's temporaries.
#pragma once

#include <cstdint>
#include <vector>

#include "model/blocks/layer.h"

namespace metrale {

// One step's residual memory, laid out by the scheme in the step's workspace.
struct ResidualStreams {
  Tensor streams;  // [T, W] activation dtype: what stream blocks act on
  Tensor input;    // [T, H]: the stack's input rows (the token embeddings), written by the caller
                   // before begin(); may be a view of the streams
  std::vector<Tensor> state;  // the scheme's own, e.g. the coefficients a pre map keeps for its post map
};

class ResidualScheme {
 public:
  virtual ~ResidualScheme() = default;

  virtual int64_t hidden_size() const = 0;   // H: the width of a site's input and output
  virtual int64_t stream_width() const = 0;  // W: the width of the streams
  virtual int64_t num_sites() const = 0;     // sites it has maps for (two per layer)

  virtual ResidualStreams allocate(const StepContext& step) const = 0;
  // Spreads `streams.input` into the streams.
  virtual void begin(const StepContext& step, const ResidualStreams& streams) const = 0;
  // x [T, H] = the input of `site`, read from the streams.
  virtual void pre(const StepContext& step, const ResidualStreams& streams, int64_t site, const Tensor& x) const = 0;
  // The streams take `out` [T, H], the output of `site`.
  virtual void post(const StepContext& step, const ResidualStreams& streams, int64_t site,
                    const Tensor& out) const = 0;
  // hidden [T, H] = the final hidden state (after the scheme's final norm, if it has one).
  virtual void finish(const StepContext& step, const ResidualStreams& streams, const Tensor& hidden) const = 0;

  // post(site, out) then pre(site + 1, next_x); `out` and `next_x` may be the same buffers the site
  // read and wrote.
  virtual void post_pre(const StepContext& step, const ResidualStreams& streams, int64_t site, const Tensor& out,
                        const Tensor& next_x) const {
    post(step, streams, site, out);
    pre(step, streams, site + 1, next_x);
  }
  // post(site, out) then finish(hidden).
  virtual void post_finish(const StepContext& step, const ResidualStreams& streams, int64_t site, const Tensor& out,
                           const Tensor& hidden) const {
    post(step, streams, site, out);
    finish(step, streams, hidden);
  }
};

}  // namespace metrale
