// dlopen/dlsym of libibverbs; see verbs_api.h for why nothing is linked.
#include "verbs_api.h"

#include <dlfcn.h>

namespace mgraph::ibv {
namespace {

template <typename Fn>
void resolve(void* lib, const char* name, Fn& out, std::string* missing) {
  out = reinterpret_cast<Fn>(dlsym(lib, name));
  if (out == nullptr && missing != nullptr) *missing += std::string(" ") + name;
}

}  // namespace

std::string Api::load(const std::vector<std::string>& libs) {
  if (loaded()) return "";
  std::string tried;
  for (const auto& name : libs) {
    lib_ = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib_ != nullptr) {
      path = name;
      break;
    }
    const char* why = dlerror();
    tried += "\n    " + name + ": " + (why ? why : "not found");
  }
  if (lib_ == nullptr) return "cannot load libibverbs:" + tried;
  std::string missing;
  resolve(lib_, "ibv_get_device_list", get_device_list, &missing);
  resolve(lib_, "ibv_free_device_list", free_device_list, &missing);
  resolve(lib_, "ibv_get_device_name", get_device_name, &missing);
  resolve(lib_, "ibv_open_device", open_device, &missing);
  resolve(lib_, "ibv_close_device", close_device, &missing);
  resolve(lib_, "ibv_query_port", query_port, &missing);
  resolve(lib_, "ibv_query_gid", query_gid, &missing);
  resolve(lib_, "ibv_alloc_pd", alloc_pd, &missing);
  resolve(lib_, "ibv_dealloc_pd", dealloc_pd, &missing);
  resolve(lib_, "ibv_reg_mr", reg_mr, &missing);
  resolve(lib_, "ibv_dereg_mr", dereg_mr, &missing);
  resolve(lib_, "ibv_create_cq", create_cq, &missing);
  resolve(lib_, "ibv_destroy_cq", destroy_cq, &missing);
  resolve(lib_, "ibv_create_qp", create_qp, &missing);
  resolve(lib_, "ibv_destroy_qp", destroy_qp, &missing);
  resolve(lib_, "ibv_reg_dmabuf_mr", reg_dmabuf_mr, nullptr);  // optional: rdma-core >= 34
  decltype(modify_qp) modify = nullptr;
  resolve(lib_, "ibv_modify_qp", modify, &missing);
  if (!missing.empty()) return path + " lacks:" + missing;
  modify_qp = modify;  // last: loaded() is true only when every required symbol resolved
  return "";
}

}  // namespace mgraph::ibv
