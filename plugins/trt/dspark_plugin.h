// dspark_plugin.h -- TensorRT IPluginV3 plugins over the DSpark verify-step kernels.
//
//   DSparkVerify   (namespace "dspark", version "1")  speculative verification
//   DSparkSchedule (namespace "dspark", version "1")  prefix scheduler, report Algorithm 1
//
// The ONNX node contract (op types, attributes, inputs, outputs, dtypes) is written down
// once in plugins/contract.py and docs/plugins.md; the constants here must match it
// (tests/unit/test_cuda_build.py checks that they do).
//
// Written against TensorRT 10.x (IPluginV3OneCore / OneBuild / OneRuntime and
// IPluginCreatorV3One). Load the shared library with IPluginRegistry::loadLibrary or
// `trtexec --dynamicPlugins=libdspark_trt_plugin.so`; it exports getCreators().
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dspark {
namespace trt {

constexpr char const* kVerifyName = "DSparkVerify";
constexpr char const* kScheduleName = "DSparkSchedule";
constexpr char const* kPluginVersion = "1";
constexpr char const* kPluginNamespace = "dspark";

// A plugin's or creator's fields, handed to TensorRT as one PluginFieldCollection.
class FieldList {
 public:
  void clear() { mFields.clear(); }
  void emplace_back(char const* name, void const* data, nvinfer1::PluginFieldType type, int32_t length) {
    mFields.emplace_back(name, data, type, length);
  }
  // The collection over the current fields (rebuilt on each call: adding may move them).
  nvinfer1::PluginFieldCollection const* collection() noexcept {
    mCollection.nbFields = static_cast<int32_t>(mFields.size());
    mCollection.fields = mFields.data();
    return &mCollection;
  }

 private:
  std::vector<nvinfer1::PluginField> mFields;
  nvinfer1::PluginFieldCollection mCollection{};
};

// What both plugins share: one object is the core, build and runtime interface, and the
// plugin ids.
class PluginV3Base : public nvinfer1::IPluginV3,
                     public nvinfer1::IPluginV3OneCore,
                     public nvinfer1::IPluginV3OneBuild,
                     public nvinfer1::IPluginV3OneRuntime {
 public:
  nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
  char const* getPluginVersion() const noexcept override { return kPluginVersion; }
  char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }
};

// What both creators share: the plugin ids and the declared fields.
class CreatorBase : public nvinfer1::IPluginCreatorV3One {
 public:
  char const* getPluginVersion() const noexcept override { return kPluginVersion; }
  char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }
  nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override { return mFields.collection(); }

 protected:
  FieldList mFields;
};

// ---------------------------------------------------------------------------------------
// DSparkVerify
//   fields : block_size (int32, K), vocab_size (int32, V), greedy (int32 0/1)
//   inputs (greedy = 0): draft_tokens [R,K] int64, draft_probs [R,K,V] f32|f16|bf16,
//            target_logits [R,K+1,V] f32|f16|bf16, verify_lens [R] int64,
//            temperature [R] f32, seed [R] int64, offset [R] int64
//   inputs (greedy = 1): draft_tokens, target_logits, verify_lens
//   outputs: num_accepted [R] int64, output_tokens [R,K+1] int64
// ---------------------------------------------------------------------------------------
class DSparkVerifyPlugin final : public PluginV3Base {
 public:
  DSparkVerifyPlugin(int32_t block_size, int32_t vocab_size, int32_t greedy);
  ~DSparkVerifyPlugin() override = default;

  // IPluginV3
  nvinfer1::IPluginV3* clone() noexcept override;

  // IPluginV3OneCore
  char const* getPluginName() const noexcept override { return kVerifyName; }

  // IPluginV3OneBuild
  int32_t getNbOutputs() const noexcept override { return 2; }
  int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
                             nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
  int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
                          int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                          nvinfer1::IExprBuilder& exprBuilder) noexcept override;
  bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override;
  int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
                          nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
  size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                          nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

  // IPluginV3OneRuntime
  int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
                        int32_t nbOutputs) noexcept override;
  int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
                  void const* const* inputs, void* const* outputs, void* workspace,
                  cudaStream_t stream) noexcept override;
  nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
  nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

  int32_t nbInputs() const { return mGreedy ? 3 : 7; }

 private:
  // Input positions; -1 where the greedy variant has no such input.
  int32_t idxTokens() const { return 0; }
  int32_t idxProbs() const { return mGreedy ? -1 : 1; }
  int32_t idxLogits() const { return mGreedy ? 1 : 2; }
  int32_t idxLens() const { return mGreedy ? 2 : 3; }
  int32_t idxTemperature() const { return mGreedy ? -1 : 4; }
  int32_t idxSeed() const { return mGreedy ? -1 : 5; }
  int32_t idxOffset() const { return mGreedy ? -1 : 6; }
  bool shapesOk(nvinfer1::Dims const* dims, int32_t nbInputs) const;

  int32_t mBlockSize;
  int32_t mVocabSize;
  int32_t mGreedy;
  FieldList mFields;
};

// ---------------------------------------------------------------------------------------
// DSparkSchedule
//   fields : block_size (int32, K), sps_table (float32[N+1], steps/s by batch tokens)
//   inputs : confidence [R,K] f32, optionally max_lens [R] int64
//   outputs: verify_lens [R] int64
// ---------------------------------------------------------------------------------------
class DSparkSchedulePlugin final : public PluginV3Base {
 public:
  DSparkSchedulePlugin(int32_t block_size, std::vector<float> sps_table);
  DSparkSchedulePlugin(DSparkSchedulePlugin const& other);
  DSparkSchedulePlugin& operator=(DSparkSchedulePlugin const&) = delete;
  ~DSparkSchedulePlugin() override;

  nvinfer1::IPluginV3* clone() noexcept override;

  char const* getPluginName() const noexcept override { return kScheduleName; }

  int32_t getNbOutputs() const noexcept override { return 1; }
  int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
                             nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
  int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
                          int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                          nvinfer1::IExprBuilder& exprBuilder) noexcept override;
  bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override;
  int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
                          nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
  size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                          nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

  int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
                        int32_t nbOutputs) noexcept override;
  int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
                  void const* const* inputs, void* const* outputs, void* workspace,
                  cudaStream_t stream) noexcept override;
  nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
  nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

 private:
  int32_t uploadTable() noexcept;  // host table -> device (float64), once per clone

  int32_t mBlockSize;
  std::vector<float> mSpsTable;
  int32_t mNbInputs{1};
  double* mDeviceTable{nullptr};
  FieldList mFields;
};

// ---------------------------------------------------------------------------------------
// Creators.
// ---------------------------------------------------------------------------------------
class DSparkVerifyCreator final : public CreatorBase {
 public:
  DSparkVerifyCreator();
  char const* getPluginName() const noexcept override { return kVerifyName; }
  nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
                                    nvinfer1::TensorRTPhase phase) noexcept override;
};

class DSparkScheduleCreator final : public CreatorBase {
 public:
  DSparkScheduleCreator();
  char const* getPluginName() const noexcept override { return kScheduleName; }
  nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
                                    nvinfer1::TensorRTPhase phase) noexcept override;
};

}  // namespace trt
}  // namespace dspark
