// The printed table and the JSON records.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "bench/record.hpp"

#ifndef XENT_SOURCE_DIR
#define XENT_SOURCE_DIR "."
#endif
#ifndef XENT_GIT_COMMIT
#define XENT_GIT_COMMIT "unknown"
#endif

namespace xent::bench {

namespace {

std::string shape_text(const Case& c) {
  std::ostringstream text;
  text << c.n;
  if (c.h > 0) text << "x" << c.h;
  text << "x" << c.v;
  return text.str();
}

std::string op_text(const Case& c) {
  std::string text = op_name(c.op);
  if (c.op == Op::distill || c.op == Op::linear_distill)
    text += std::string(":") + distill_kind_name(c.kind);
  if (c.mode == Mode::fwd) text += " fwd";
  return text;
}

std::string number(double value, const char* format) {
  if (std::isnan(value)) return "-";
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, format, value);
  return buffer;
}

std::string escaped(const std::string& text) {
  std::string out;
  for (const char ch : text) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      char buffer[8];
      std::snprintf(buffer, sizeof buffer, "\\u%04x", ch);
      out += buffer;
    } else {
      out += ch;
    }
  }
  return out;
}

// JSON string literal (or null for an absent value). Built by append: GCC 12 warns falsely
// (-Wrestrict) on `"\"" + std::string(...)`.
std::string quoted(const char* text) {
  if (!text) return "null";
  std::string out = "\"";
  out.append(escaped(text));
  out.push_back('"');
  return out;
}

std::string options_text(const Case& c) {
  std::string text = c.options.describe();
  if (c.reduction != Reduction::mean) {
    text.push_back(' ');
    text.append(reduction_name(c.reduction));
  }
  if (c.fp32_logits) text.append(" fp32-logits");
  return text;
}

std::string json_number(double value) {
  if (!std::isfinite(value)) return "null";
  std::ostringstream text;
  text.precision(9);
  text << value;
  return text.str();
}

}  // namespace

void print_table(const std::vector<Record>& records) {
  std::printf("%-26s %-6s %-20s %-8s %-14s %10s %10s %10s %10s %8s %10s %10s\n", "op", "impl",
              "shape", "dtype", "options", "median ms", "p20 ms", "p80 ms", "extra MiB", "ratio",
              "loss err", "grad err");
  for (const Record& r : records) {
    const Case& c = r.spec;
    std::printf("%-26s %-6s %-20s %-8s %-14s ", op_text(c).c_str(), r.impl.c_str(),
                shape_text(c).c_str(), dtype_name(c.dtype), options_text(c).c_str());
    if (!r.error.empty()) {
      std::printf("error: %s\n", r.error.c_str());
      continue;
    }
    std::printf("%10s %10s %10s %10s %8s %10s %10s\n", number(r.time.median_ms, "%.3f").c_str(),
                number(r.time.p20_ms, "%.3f").c_str(), number(r.time.p80_ms, "%.3f").c_str(),
                number(static_cast<double>(r.peak_extra_bytes) / (1 << 20), "%.1f").c_str(),
                number(r.ratio, "%.3f").c_str(), number(r.loss_rel_err, "%.2e").c_str(),
                number(r.grad_rel_err, "%.2e").c_str());
  }
  // One line per case comparing xent with the naive form measured beside it.
  for (std::size_t i = 0; i + 1 < records.size(); ++i) {
    const Record& x = records[i];
    const Record& naive = records[i + 1];
    if (x.impl != "xent" || naive.impl != "naive" || !x.error.empty() || !naive.error.empty())
      continue;
    std::printf(
        "%s %s: xent takes %.2fx the naive time and %.2fx its extra memory (%.1f vs "
        "%.1f MiB)\n",
        op_text(x.spec).c_str(), shape_text(x.spec).c_str(),
        x.time.median_ms / naive.time.median_ms,
        static_cast<double>(x.peak_extra_bytes) / static_cast<double>(naive.peak_extra_bytes),
        static_cast<double>(x.peak_extra_bytes) / (1 << 20),
        static_cast<double>(naive.peak_extra_bytes) / (1 << 20));
  }
  bool any_ceiling = false;
  for (const Record& r : records) {
    if (r.copy_bandwidth > 0 && !any_ceiling) {
      std::printf("copy bandwidth B = %.1f GB/s (read + written)\n", r.copy_bandwidth / 1e9);
      any_ceiling = true;
    }
  }
  for (const Record& r : records)
    if (r.gemm_floor_ms > 0 && r.impl == "xent")
      std::printf("GEMM floor F %s %s = %.3f ms\n", op_text(r.spec).c_str(),
                  shape_text(r.spec).c_str(), r.gemm_floor_ms);
}

std::string git_commit() {
  // A copy of the tree without .git (a GPU machine gets the files only) names it through the
  // environment.
  if (const char* given = std::getenv("XENT_COMMIT"); given != nullptr && *given != '\0') {
    return given;
  }
  std::string command = std::string("git -C '") + XENT_SOURCE_DIR + "' rev-parse HEAD 2>/dev/null";
  if (FILE* pipe = popen(command.c_str(), "r")) {
    char buffer[128] = {};
    const bool read = std::fgets(buffer, sizeof buffer, pipe) != nullptr;
    pclose(pipe);
    std::string commit = read ? buffer : "";
    while (!commit.empty() && (commit.back() == '\n' || commit.back() == '\r')) commit.pop_back();
    if (commit.size() == 40) return commit;
  }
  return XENT_GIT_COMMIT;
}

// The build's cubins as a JSON array ("sm_80", "sm_90a", ...; empty without CUDA).
std::string cuda_archs_json() {
  const std::string joined = XENT_BENCH_CUDA_ARCHS;
  std::string out = "[";
  std::size_t begin = 0;
  while (begin < joined.size()) {
    const std::size_t end = std::min(joined.find(',', begin), joined.size());
    out += (out.size() > 1 ? ", \"" : "\"") + joined.substr(begin, end - begin) + "\"";
    begin = end + 1;
  }
  return out + "]";
}

void write_json(const std::string& path, const std::vector<Record>& records) {
  std::ofstream file(path);
  if (!file) throw std::runtime_error("cannot write " + path);
  const std::string commit = git_commit();
  const std::string cuda_archs = cuda_archs_json();
  file << "[\n";
  for (std::size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    const Case& c = r.spec;
    file << "  {\"op\": \"" << op_name(c.op) << "\", \"impl\": \"" << escaped(r.impl)
         << "\", \"mode\": \"" << mode_name(c.mode) << "\", \"options\": \"" << c.options.describe()
         << "\", \"reduction\": \"" << reduction_name(c.reduction) << "\", \"kind\": "
         << quoted(c.op == Op::distill || c.op == Op::linear_distill ? distill_kind_name(c.kind)
                                                                     : nullptr)
         << ", \"dtype\": \"" << dtype_name(c.dtype) << "\", \"n\": " << c.n << ", \"h\": " << c.h
         << ", \"v\": " << c.v << ", \"budget_bytes\": " << c.budget_bytes
         << ", \"fp32_logits\": " << (c.fp32_logits ? "true" : "false") << ", \"label\": \""
         << escaped(c.label) << "\", \"device\": \"" << escaped(r.device_name)
         << "\", \"time_ms\": {\"median\": " << json_number(r.time.median_ms)
         << ", \"p20\": " << json_number(r.time.p20_ms)
         << ", \"p80\": " << json_number(r.time.p80_ms) << ", \"samples\": " << r.time.samples
         << "}, \"copy_bandwidth_bytes_per_s\": "
         << json_number(r.copy_bandwidth > 0 ? r.copy_bandwidth : NAN)
         << ", \"gemm_floor_ms\": " << json_number(r.gemm_floor_ms > 0 ? r.gemm_floor_ms : NAN)
         << ", \"ratio\": " << json_number(r.ratio) << ", \"ratio_kind\": \"" << r.ratio_kind
         << "\", \"min_bytes\": " << r.min_bytes << ", \"peak_extra_bytes\": " << r.peak_extra_bytes
         << ", \"workspace_bytes\": " << r.workspace_bytes
         << ", \"loss_rel_err\": " << json_number(r.loss_rel_err)
         << ", \"grad_rel_err\": " << json_number(r.grad_rel_err)
         << ", \"error\": " << quoted(r.error.empty() ? nullptr : r.error.c_str())
         << ", \"commit\": \"" << commit << "\", \"cuda_archs\": " << cuda_archs << "}"
         << (i + 1 < records.size() ? "," : "") << "\n";
  }
  file << "]\n";
  if (!file) throw std::runtime_error("cannot write " + path);
}

}  // namespace xent::bench
