// dspark_plugin.cpp -- IPluginV3 implementations of DSparkVerify and DSparkSchedule, and the
// plugin-library entry points (getCreators / setLoggerFinder). Kernels: plugins/csrc via
// dspark_kernels.h (the same code the PyTorch op runs).
#include "dspark_plugin.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <utility>

#include "dspark_kernels.h"

using namespace nvinfer1;

namespace dspark {
namespace trt {
namespace {

ILoggerFinder* gLoggerFinder = nullptr;

void logError(std::string const& msg) noexcept {
  if (gLoggerFinder == nullptr) return;
  if (ILogger* logger = gLoggerFinder->findLogger()) logger->log(ILogger::Severity::kERROR, msg.c_str());
}

bool isFloatType(DataType t) { return t == DataType::kFLOAT || t == DataType::kHALF || t == DataType::kBF16; }

DType toKernelType(DataType t) {
  switch (t) {
    case DataType::kHALF: return DType::kFloat16;
    case DataType::kBF16: return DType::kBFloat16;
    default: return DType::kFloat32;
  }
}

// Reads an integer field (int32, or int64 when a caller passes one); false if absent / malformed.
bool readInt(PluginField const& f, int32_t& out) {
  if (f.data == nullptr || f.length < 1) return false;
  if (f.type == PluginFieldType::kINT32) {
    out = *static_cast<int32_t const*>(f.data);
    return true;
  }
  if (f.type == PluginFieldType::kINT64) {
    out = static_cast<int32_t>(*static_cast<int64_t const*>(f.data));
    return true;
  }
  return false;
}

bool readFloats(PluginField const& f, std::vector<float>& out) {
  if (f.data == nullptr || f.length < 1) return false;
  out.resize(static_cast<size_t>(f.length));
  if (f.type == PluginFieldType::kFLOAT32) {
    std::memcpy(out.data(), f.data, sizeof(float) * out.size());
    return true;
  }
  if (f.type == PluginFieldType::kFLOAT64) {
    auto const* d = static_cast<double const*>(f.data);
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(d[i]);
    return true;
  }
  return false;
}

// A known dimension that differs from `want` (-1 = not known yet, accepted).
bool dimMismatch(int64_t have, int64_t want) { return have >= 0 && have != want; }

}  // namespace

IPluginCapability* PluginV3Base::getCapabilityInterface(PluginCapabilityType type) noexcept {
  switch (type) {
    case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
  }
  return nullptr;
}

// =======================================================================================
// DSparkVerify
// =======================================================================================
DSparkVerifyPlugin::DSparkVerifyPlugin(int32_t block_size, int32_t vocab_size, int32_t greedy)
    : mBlockSize(block_size), mVocabSize(vocab_size), mGreedy(greedy ? 1 : 0) {}

IPluginV3* DSparkVerifyPlugin::clone() noexcept {
  try {
    return new DSparkVerifyPlugin(mBlockSize, mVocabSize, mGreedy);
  } catch (std::exception const& e) {
    logError(std::string("DSparkVerify clone: ") + e.what());
  }
  return nullptr;
}

int32_t DSparkVerifyPlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                                               int32_t nbInputs) const noexcept {
  (void)inputTypes;
  if (nbOutputs != 2 || nbInputs != this->nbInputs()) return -1;
  outputTypes[0] = DataType::kINT64;  // num_accepted
  outputTypes[1] = DataType::kINT64;  // output_tokens
  return 0;
}

int32_t DSparkVerifyPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* shapeInputs,
                                            int32_t nbShapeInputs, DimsExprs* outputs, int32_t nbOutputs,
                                            IExprBuilder& exprBuilder) noexcept {
  (void)shapeInputs;
  (void)nbShapeInputs;
  if (nbInputs != this->nbInputs() || nbOutputs != 2 || inputs[idxTokens()].nbDims != 2) return -1;
  IDimensionExpr const* R = inputs[idxTokens()].d[0];
  outputs[0].nbDims = 1;
  outputs[0].d[0] = R;
  outputs[1].nbDims = 2;
  outputs[1].d[0] = R;
  outputs[1].d[1] = exprBuilder.constant(static_cast<int64_t>(mBlockSize) + 1);
  return 0;
}

bool DSparkVerifyPlugin::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                                   int32_t nbOutputs) noexcept {
  if (nbInputs != this->nbInputs() || nbOutputs != 2 || pos < 0 || pos >= nbInputs + nbOutputs) return false;
  PluginTensorDesc const& d = inOut[pos].desc;
  if (d.format != TensorFormat::kLINEAR) return false;
  if (pos >= nbInputs) return d.type == DataType::kINT64;
  if (pos == idxTokens() || pos == idxLens() || pos == idxSeed() || pos == idxOffset()) return d.type == DataType::kINT64;
  if (pos == idxTemperature()) return d.type == DataType::kFLOAT;
  if (pos == idxProbs()) return isFloatType(d.type);
  if (pos == idxLogits()) {
    if (!isFloatType(d.type)) return false;
    if (mGreedy) return true;
    DataType const probs = inOut[idxProbs()].desc.type;  // decided earlier (lower position)
    return probs == DataType::kFLOAT || probs == d.type;
  }
  return false;
}

bool DSparkVerifyPlugin::shapesOk(Dims const* dims, int32_t nbInputs) const {
  if (nbInputs != this->nbInputs()) return false;
  Dims const& tok = dims[idxTokens()];
  Dims const& lg = dims[idxLogits()];
  if (tok.nbDims != 2 || lg.nbDims != 3 || dims[idxLens()].nbDims != 1) return false;
  int64_t const R = tok.d[0];
  if (dimMismatch(tok.d[1], mBlockSize) || dimMismatch(lg.d[1], mBlockSize + 1) || dimMismatch(lg.d[2], mVocabSize))
    return false;
  if (R >= 0 && (dimMismatch(lg.d[0], R) || dimMismatch(dims[idxLens()].d[0], R))) return false;
  if (!mGreedy) {
    Dims const& pr = dims[idxProbs()];
    if (pr.nbDims != 3 || dimMismatch(pr.d[1], mBlockSize) || dimMismatch(pr.d[2], mVocabSize)) return false;
    if (R >= 0 && dimMismatch(pr.d[0], R)) return false;
    for (int32_t i : {idxTemperature(), idxSeed(), idxOffset()})
      if (dims[i].nbDims != 1 || (R >= 0 && dimMismatch(dims[i].d[0], R))) return false;
  }
  return true;
}

int32_t DSparkVerifyPlugin::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
                                            DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept {
  (void)out;
  if (nbOutputs != 2 || nbInputs != this->nbInputs()) return -1;
  std::vector<Dims> dims(static_cast<size_t>(nbInputs));
  for (int32_t i = 0; i < nbInputs; ++i) dims[i] = in[i].desc.dims;
  if (!shapesOk(dims.data(), nbInputs)) {
    logError("DSparkVerify: input shapes do not match block_size/vocab_size (see plugins/contract.py)");
    return -1;
  }
  return 0;
}

size_t DSparkVerifyPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                                            DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept {
  (void)outputs;
  (void)nbOutputs;
  if (nbInputs != this->nbInputs()) return 0;
  int64_t const maxR = inputs[idxTokens()].max.d[0];
  return verify_workspace_bytes(static_cast<int32_t>(maxR), mBlockSize, mVocabSize);
}

int32_t DSparkVerifyPlugin::onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out,
                                          int32_t nbOutputs) noexcept {
  (void)out;
  if (nbOutputs != 2 || nbInputs != this->nbInputs()) return -1;
  std::vector<Dims> dims(static_cast<size_t>(nbInputs));
  for (int32_t i = 0; i < nbInputs; ++i) dims[i] = in[i].dims;
  return shapesOk(dims.data(), nbInputs) ? 0 : -1;
}

int32_t DSparkVerifyPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
                                    void const* const* inputs, void* const* outputs, void* workspace,
                                    cudaStream_t stream) noexcept {
  (void)outputDesc;
  VerifyParams p;
  p.R = static_cast<int32_t>(inputDesc[idxTokens()].dims.d[0]);
  p.K = mBlockSize;
  p.V = mVocabSize;
  p.draft_tokens = static_cast<int64_t const*>(inputs[idxTokens()]);
  p.target_logits = inputs[idxLogits()];
  p.logits_dtype = toKernelType(inputDesc[idxLogits()].type);
  p.verify_lens = static_cast<int64_t const*>(inputs[idxLens()]);
  if (!mGreedy) {
    p.draft_probs = inputs[idxProbs()];
    p.draft_dtype = toKernelType(inputDesc[idxProbs()].type);
    p.temperature = static_cast<float const*>(inputs[idxTemperature()]);
    p.seed = static_cast<int64_t const*>(inputs[idxSeed()]);
    p.offset = static_cast<int64_t const*>(inputs[idxOffset()]);
  }
  p.all_greedy = mGreedy != 0;
  p.num_accepted = static_cast<int64_t*>(outputs[0]);
  p.output_tokens = static_cast<int64_t*>(outputs[1]);
  size_t const bytes = verify_workspace_bytes(p.R, p.K, p.V);
  cudaError_t const err = verify(p, workspace, bytes, stream);
  if (err != cudaSuccess) {
    logError(std::string("DSparkVerify enqueue: ") + cudaGetErrorString(err));
    return -1;
  }
  return 0;
}

IPluginV3* DSparkVerifyPlugin::attachToContext(IPluginResourceContext* context) noexcept {
  (void)context;
  return clone();
}

PluginFieldCollection const* DSparkVerifyPlugin::getFieldsToSerialize() noexcept {
  mFields.clear();
  mFields.emplace_back("block_size", &mBlockSize, PluginFieldType::kINT32, 1);
  mFields.emplace_back("vocab_size", &mVocabSize, PluginFieldType::kINT32, 1);
  mFields.emplace_back("greedy", &mGreedy, PluginFieldType::kINT32, 1);
  return mFields.collection();
}

// =======================================================================================
// DSparkSchedule
// =======================================================================================
DSparkSchedulePlugin::DSparkSchedulePlugin(int32_t block_size, std::vector<float> sps_table)
    : mBlockSize(block_size), mSpsTable(std::move(sps_table)) {}

DSparkSchedulePlugin::DSparkSchedulePlugin(DSparkSchedulePlugin const& other)
    : PluginV3Base(other),
      mBlockSize(other.mBlockSize),
      mSpsTable(other.mSpsTable),
      mNbInputs(other.mNbInputs) {}  // the device table is per object: never shared

DSparkSchedulePlugin::~DSparkSchedulePlugin() {
  if (mDeviceTable != nullptr) cudaFree(mDeviceTable);
}

IPluginV3* DSparkSchedulePlugin::clone() noexcept {
  try {
    return new DSparkSchedulePlugin(*this);
  } catch (std::exception const& e) {
    logError(std::string("DSparkSchedule clone: ") + e.what());
  }
  return nullptr;
}

int32_t DSparkSchedulePlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                                                 int32_t nbInputs) const noexcept {
  (void)inputTypes;
  if (nbOutputs != 1 || nbInputs < 1 || nbInputs > 2) return -1;
  outputTypes[0] = DataType::kINT64;  // verify_lens
  return 0;
}

int32_t DSparkSchedulePlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* shapeInputs,
                                              int32_t nbShapeInputs, DimsExprs* outputs, int32_t nbOutputs,
                                              IExprBuilder& exprBuilder) noexcept {
  (void)shapeInputs;
  (void)nbShapeInputs;
  (void)exprBuilder;
  if (nbOutputs != 1 || nbInputs < 1 || nbInputs > 2 || inputs[0].nbDims != 2) return -1;
  outputs[0].nbDims = 1;
  outputs[0].d[0] = inputs[0].d[0];
  return 0;
}

bool DSparkSchedulePlugin::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut,
                                                     int32_t nbInputs, int32_t nbOutputs) noexcept {
  if (nbOutputs != 1 || nbInputs < 1 || nbInputs > 2 || pos < 0 || pos >= nbInputs + nbOutputs) return false;
  PluginTensorDesc const& d = inOut[pos].desc;
  if (d.format != TensorFormat::kLINEAR) return false;
  if (pos == 0) return d.type == DataType::kFLOAT;  // confidence
  return d.type == DataType::kINT64;                // max_lens, verify_lens
}

int32_t DSparkSchedulePlugin::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
                                              DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept {
  (void)out;
  if (nbOutputs != 1 || nbInputs < 1 || nbInputs > 2) return -1;
  mNbInputs = nbInputs;
  Dims const& c = in[0].desc.dims;
  if (c.nbDims != 2 || dimMismatch(c.d[1], mBlockSize)) {
    logError("DSparkSchedule: confidence must be [R, block_size]");
    return -1;
  }
  int64_t const maxR = in[0].max.d[0];
  if (maxR > 0 && maxR * mBlockSize > schedule_max_candidates()) {
    logError("DSparkSchedule: R * block_size exceeds the scheduler kernel's capacity (" +
             std::to_string(schedule_max_candidates()) + ", plugins/contract.py SCHEDULE_MAX_CANDIDATES)");
    return -1;
  }
  return 0;
}

size_t DSparkSchedulePlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                                              DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept {
  (void)inputs;
  (void)nbInputs;
  (void)outputs;
  (void)nbOutputs;
  return 0;
}

int32_t DSparkSchedulePlugin::onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out,
                                            int32_t nbOutputs) noexcept {
  (void)out;
  if (nbOutputs != 1 || nbInputs < 1 || nbInputs > 2) return -1;
  mNbInputs = nbInputs;
  Dims const& c = in[0].dims;
  if (c.nbDims != 2 || c.d[1] != mBlockSize) return -1;
  if (nbInputs == 2 && (in[1].dims.nbDims != 1 || in[1].dims.d[0] != c.d[0])) return -1;
  return 0;
}

int32_t DSparkSchedulePlugin::uploadTable() noexcept {
  if (mDeviceTable != nullptr) return 0;
  std::vector<double> host(mSpsTable.begin(), mSpsTable.end());
  if (cudaMalloc(reinterpret_cast<void**>(&mDeviceTable), sizeof(double) * host.size()) != cudaSuccess) {
    mDeviceTable = nullptr;
    return -1;
  }
  if (cudaMemcpy(mDeviceTable, host.data(), sizeof(double) * host.size(), cudaMemcpyHostToDevice) != cudaSuccess)
    return -1;
  return 0;
}

int32_t DSparkSchedulePlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
                                      void const* const* inputs, void* const* outputs, void* workspace,
                                      cudaStream_t stream) noexcept {
  (void)outputDesc;
  (void)workspace;
  if (mDeviceTable == nullptr && uploadTable() != 0) {  // normally done in attachToContext
    logError("DSparkSchedule: could not upload the SPS table");
    return -1;
  }
  ScheduleParams p;
  p.R = static_cast<int32_t>(inputDesc[0].dims.d[0]);
  p.K = mBlockSize;
  p.n_sps = static_cast<int32_t>(mSpsTable.size());
  p.confidence_f32 = static_cast<float const*>(inputs[0]);
  p.sps = mDeviceTable;
  p.max_lens = mNbInputs > 1 ? static_cast<int64_t const*>(inputs[1]) : nullptr;
  p.verify_lens = static_cast<int64_t*>(outputs[0]);
  p.early_stop = true;  // the lossless scheduler; the variant without the stop is for tests only
  cudaError_t const err = schedule_prefix(p, stream);
  if (err != cudaSuccess) {
    logError(std::string("DSparkSchedule enqueue: ") + cudaGetErrorString(err));
    return -1;
  }
  return 0;
}

IPluginV3* DSparkSchedulePlugin::attachToContext(IPluginResourceContext* context) noexcept {
  (void)context;
  auto* p = static_cast<DSparkSchedulePlugin*>(clone());
  if (p != nullptr && p->uploadTable() != 0) logError("DSparkSchedule: could not upload the SPS table");
  return p;
}

PluginFieldCollection const* DSparkSchedulePlugin::getFieldsToSerialize() noexcept {
  mFields.clear();
  mFields.emplace_back("block_size", &mBlockSize, PluginFieldType::kINT32, 1);
  mFields.emplace_back("sps_table", mSpsTable.data(), PluginFieldType::kFLOAT32, static_cast<int32_t>(mSpsTable.size()));
  return mFields.collection();
}

// =======================================================================================
// Creators
// =======================================================================================
DSparkVerifyCreator::DSparkVerifyCreator() {
  mFields.emplace_back("block_size", nullptr, PluginFieldType::kINT32, 1);
  mFields.emplace_back("vocab_size", nullptr, PluginFieldType::kINT32, 1);
  mFields.emplace_back("greedy", nullptr, PluginFieldType::kINT32, 1);
}

IPluginV3* DSparkVerifyCreator::createPlugin(char const* name, PluginFieldCollection const* fc,
                                             TensorRTPhase phase) noexcept {
  (void)name;
  (void)phase;  // the same fields at build and at runtime
  try {
    int32_t block_size = -1, vocab_size = -1, greedy = 0;
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
      PluginField const& f = fc->fields[i];
      if (f.name == nullptr) continue;
      bool ok = true;
      if (std::strcmp(f.name, "block_size") == 0) ok = readInt(f, block_size);
      else if (std::strcmp(f.name, "vocab_size") == 0) ok = readInt(f, vocab_size);
      else if (std::strcmp(f.name, "greedy") == 0) ok = readInt(f, greedy);
      if (!ok) {
        logError(std::string("DSparkVerify: field '") + f.name + "' must be an int32 scalar");
        return nullptr;
      }
    }
    if (block_size < 0 || vocab_size < 1 || (greedy != 0 && greedy != 1)) {
      logError("DSparkVerify: needs block_size >= 0, vocab_size >= 1, greedy in {0, 1}");
      return nullptr;
    }
    return new DSparkVerifyPlugin(block_size, vocab_size, greedy);
  } catch (std::exception const& e) {
    logError(std::string("DSparkVerify createPlugin: ") + e.what());
  }
  return nullptr;
}

DSparkScheduleCreator::DSparkScheduleCreator() {
  mFields.emplace_back("block_size", nullptr, PluginFieldType::kINT32, 1);
  mFields.emplace_back("sps_table", nullptr, PluginFieldType::kFLOAT32, 0);
}

IPluginV3* DSparkScheduleCreator::createPlugin(char const* name, PluginFieldCollection const* fc,
                                               TensorRTPhase phase) noexcept {
  (void)name;
  (void)phase;
  try {
    int32_t block_size = -1;
    std::vector<float> table;
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
      PluginField const& f = fc->fields[i];
      if (f.name == nullptr) continue;
      bool ok = true;
      if (std::strcmp(f.name, "block_size") == 0) ok = readInt(f, block_size);
      else if (std::strcmp(f.name, "sps_table") == 0) ok = readFloats(f, table);
      if (!ok) {
        logError(std::string("DSparkSchedule: malformed field '") + f.name + "'");
        return nullptr;
      }
    }
    if (block_size < 1 || table.size() < 2) {
      logError("DSparkSchedule: needs block_size >= 1 and an sps_table of at least 2 entries");
      return nullptr;
    }
    return new DSparkSchedulePlugin(block_size, std::move(table));
  } catch (std::exception const& e) {
    logError(std::string("DSparkSchedule createPlugin: ") + e.what());
  }
  return nullptr;
}

}  // namespace trt
}  // namespace dspark

// ---------------------------------------------------------------------------------------
// Plugin-library entry points (IPluginRegistry::loadLibrary, trtexec --dynamicPlugins).
// ---------------------------------------------------------------------------------------
extern "C" {

__attribute__((visibility("default"))) void setLoggerFinder(nvinfer1::ILoggerFinder* finder) {
  dspark::trt::gLoggerFinder = finder;
}

__attribute__((visibility("default"))) nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  static dspark::trt::DSparkVerifyCreator verifyCreator;
  static dspark::trt::DSparkScheduleCreator scheduleCreator;
  static nvinfer1::IPluginCreatorInterface* const creators[] = {&verifyCreator, &scheduleCreator};
  nbCreators = 2;
  return creators;
}

}  // extern "C"
