// The raw Vulkan floor of the Vulkan benchmark (hcq/bench/vk_peers.py loads it with ctypes): one instance, one
// physical device, one compute queue, one command buffer, one timeline semaphore. Every submit signals the next
// value of the timeline and the host waits for it with vkWaitSemaphores. Times are CLOCK_MONOTONIC nanoseconds;
// statistics are left to the caller. Functions return 0 on success, -1 with vkb_error() saying what failed.
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <vulkan/vulkan.h>

#define WAIT_TIMEOUT_NS 30000000000ull  // a wait longer than this is reported as a hang, not waited out

typedef struct vkb {
  VkInstance inst;
  VkPhysicalDevice phys;
  VkDevice dev;
  VkQueue queue;
  VkCommandPool pool;
  VkCommandBuffer cmd;
  VkSemaphore timeline;
  uint64_t value;  // last value a submit signalled
  VkShaderModule shader;
  VkPipelineLayout layout;
  VkPipeline pipeline;
  VkBuffer buf[2];  // copy source, destination
  VkDeviceMemory mem[2];
  VkDeviceSize copy_bytes;
  uint32_t mem_flags;  // VkMemoryPropertyFlags of the copy buffers' memory type
  char name[VK_MAX_PHYSICAL_DEVICE_NAME_SIZE];
  char err[512];
} vkb;

static int fail(char *err, size_t len, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, len, fmt, ap);
  va_end(ap);
  return -1;
}

// Evaluate a Vulkan call; on failure record which call and its VkResult and return -1 from the caller.
#define VK(b, call) do { VkResult r_ = (call); \
    if (r_ != VK_SUCCESS) return fail((b)->err, sizeof (b)->err, "%s failed: VkResult %d", #call, (int)r_); } while (0)

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

// Submit the command buffer signalling the next timeline value (returned in *value).
static int submit(vkb *b, uint64_t *value) {
  *value = ++b->value;
  VkTimelineSemaphoreSubmitInfo tl = {.sType = VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO,
                                      .signalSemaphoreValueCount = 1, .pSignalSemaphoreValues = value};
  VkSubmitInfo si = {.sType = VK_STRUCTURE_TYPE_SUBMIT_INFO, .pNext = &tl, .commandBufferCount = 1, .pCommandBuffers = &b->cmd,
                     .signalSemaphoreCount = 1, .pSignalSemaphores = &b->timeline};
  VK(b, vkQueueSubmit(b->queue, 1, &si, VK_NULL_HANDLE));
  return 0;
}

static int wait_value(vkb *b, uint64_t value) {
  VkSemaphoreWaitInfo wi = {.sType = VK_STRUCTURE_TYPE_SEMAPHORE_WAIT_INFO, .semaphoreCount = 1, .pSemaphores = &b->timeline,
                            .pValues = &value};
  VkResult r = vkWaitSemaphores(b->dev, &wi, WAIT_TIMEOUT_NS);
  if (r == VK_TIMEOUT) return fail(b->err, sizeof b->err, "vkWaitSemaphores: value %llu not signalled within %llu s",
                                   (unsigned long long)value, WAIT_TIMEOUT_NS / 1000000000ull);
  VK(b, r);
  return 0;
}

static int begin(vkb *b) {
  VK(b, vkResetCommandPool(b->dev, b->pool, 0));
  VkCommandBufferBeginInfo bi = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
                                 .flags = VK_COMMAND_BUFFER_USAGE_SIMULTANEOUS_USE_BIT};  // pipelined: pending many times
  VK(b, vkBeginCommandBuffer(b->cmd, &bi));
  return 0;
}

// Record k empty dispatches, each after a compute->compute barrier (so each runs after everything before it in
// the queue, also across submits), into the command buffer.
static int record_dispatches(vkb *b, int k) {
  if (begin(b)) return -1;
  VkMemoryBarrier mb = {.sType = VK_STRUCTURE_TYPE_MEMORY_BARRIER, .srcAccessMask = VK_ACCESS_SHADER_WRITE_BIT,
                        .dstAccessMask = VK_ACCESS_SHADER_READ_BIT | VK_ACCESS_SHADER_WRITE_BIT};
  vkCmdBindPipeline(b->cmd, VK_PIPELINE_BIND_POINT_COMPUTE, b->pipeline);
  for (int i = 0; i < k; i++) {
    vkCmdPipelineBarrier(b->cmd, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, 0, 1, &mb, 0, NULL, 0, NULL);
    vkCmdDispatch(b->cmd, 1, 1, 1);
  }
  VK(b, vkEndCommandBuffer(b->cmd));
  return 0;
}

// Time `reps` submit+wait round trips of what the command buffer holds.
static int time_round_trips(vkb *b, int reps, double *ns_out) {
  for (int i = 0; i < reps; i++) {
    uint64_t t = now_ns(), v;
    if (submit(b, &v) || wait_value(b, v)) return -1;
    ns_out[i] = (double)(now_ns() - t);
  }
  return 0;
}

static int create_buffer(vkb *b, int i, VkBufferUsageFlags usage) {
  VkBufferCreateInfo ci = {.sType = VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, .size = b->copy_bytes, .usage = usage,
                           .sharingMode = VK_SHARING_MODE_EXCLUSIVE};
  VK(b, vkCreateBuffer(b->dev, &ci, NULL, &b->buf[i]));
  VkMemoryRequirements req;
  vkGetBufferMemoryRequirements(b->dev, b->buf[i], &req);
  VkPhysicalDeviceMemoryProperties mp;
  vkGetPhysicalDeviceMemoryProperties(b->phys, &mp);
  int type = -1;
  for (uint32_t t = 0; t < mp.memoryTypeCount; t++) {  // the first DEVICE_LOCAL type allowed, else the first allowed
    if (!(req.memoryTypeBits & (1u << t))) continue;
    if (mp.memoryTypes[t].propertyFlags & VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT) { type = (int)t; break; }
    if (type < 0) type = (int)t;
  }
  if (type < 0) return fail(b->err, sizeof b->err, "no memory type for a %llu-byte buffer (memoryTypeBits 0x%x)",
                            (unsigned long long)b->copy_bytes, req.memoryTypeBits);
  b->mem_flags = mp.memoryTypes[type].propertyFlags;
  VkMemoryAllocateInfo ai = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO, .allocationSize = req.size, .memoryTypeIndex = (uint32_t)type};
  VK(b, vkAllocateMemory(b->dev, &ai, NULL, &b->mem[i]));
  VK(b, vkBindBufferMemory(b->dev, b->buf[i], b->mem[i], 0));
  return 0;
}

static int setup(vkb *b, int index, const uint32_t *spirv, size_t spirv_bytes) {
  VkApplicationInfo app = {.sType = VK_STRUCTURE_TYPE_APPLICATION_INFO, .pApplicationName = "hcq-bench-vk-raw", .apiVersion = VK_API_VERSION_1_2};
  VkInstanceCreateInfo ici = {.sType = VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, .pApplicationInfo = &app};
  VK(b, vkCreateInstance(&ici, NULL, &b->inst));
  uint32_t n = 0;
  VK(b, vkEnumeratePhysicalDevices(b->inst, &n, NULL));
  if (index < 0 || (uint32_t)index >= n) return fail(b->err, sizeof b->err, "no Vulkan physical device %d (there are %u)", index, n);
  VkPhysicalDevice *all = calloc(n, sizeof *all);
  if (!all) return fail(b->err, sizeof b->err, "out of memory");
  VkResult r = vkEnumeratePhysicalDevices(b->inst, &n, all);
  b->phys = all[index];
  free(all);
  if (r != VK_SUCCESS && r != VK_INCOMPLETE) return fail(b->err, sizeof b->err, "vkEnumeratePhysicalDevices failed: VkResult %d", (int)r);
  VkPhysicalDeviceProperties props;
  vkGetPhysicalDeviceProperties(b->phys, &props);
  snprintf(b->name, sizeof b->name, "%s", props.deviceName);
  VkPhysicalDeviceTimelineSemaphoreFeatures tlf = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_TIMELINE_SEMAPHORE_FEATURES};
  VkPhysicalDeviceFeatures2 f2 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, .pNext = &tlf};
  if (props.apiVersion < VK_API_VERSION_1_2) return fail(b->err, sizeof b->err, "%s supports Vulkan %u.%u; timeline semaphores need 1.2",
                                                        b->name, VK_API_VERSION_MAJOR(props.apiVersion), VK_API_VERSION_MINOR(props.apiVersion));
  vkGetPhysicalDeviceFeatures2(b->phys, &f2);
  if (!tlf.timelineSemaphore) return fail(b->err, sizeof b->err, "%s lacks the timelineSemaphore feature", b->name);
  uint32_t nq = 0, family = UINT32_MAX;
  vkGetPhysicalDeviceQueueFamilyProperties(b->phys, &nq, NULL);
  VkQueueFamilyProperties qf[16];
  if (nq > 16) nq = 16;
  vkGetPhysicalDeviceQueueFamilyProperties(b->phys, &nq, qf);
  for (uint32_t i = 0; i < nq && family == UINT32_MAX; i++) if (qf[i].queueFlags & VK_QUEUE_COMPUTE_BIT) family = i;
  if (family == UINT32_MAX) return fail(b->err, sizeof b->err, "%s has no compute queue family", b->name);
  float prio = 1.0f;
  VkDeviceQueueCreateInfo qci = {.sType = VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO, .queueFamilyIndex = family, .queueCount = 1,
                                 .pQueuePriorities = &prio};
  tlf.pNext = NULL;  // enable exactly the timeline feature
  VkDeviceCreateInfo dci = {.sType = VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, .pNext = &tlf, .queueCreateInfoCount = 1, .pQueueCreateInfos = &qci};
  VK(b, vkCreateDevice(b->phys, &dci, NULL, &b->dev));
  vkGetDeviceQueue(b->dev, family, 0, &b->queue);
  VkCommandPoolCreateInfo pci = {.sType = VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO, .queueFamilyIndex = family};
  VK(b, vkCreateCommandPool(b->dev, &pci, NULL, &b->pool));
  VkCommandBufferAllocateInfo cai = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO, .commandPool = b->pool,
                                     .level = VK_COMMAND_BUFFER_LEVEL_PRIMARY, .commandBufferCount = 1};
  VK(b, vkAllocateCommandBuffers(b->dev, &cai, &b->cmd));
  VkSemaphoreTypeCreateInfo sti = {.sType = VK_STRUCTURE_TYPE_SEMAPHORE_TYPE_CREATE_INFO, .semaphoreType = VK_SEMAPHORE_TYPE_TIMELINE};
  VkSemaphoreCreateInfo sci = {.sType = VK_STRUCTURE_TYPE_SEMAPHORE_CREATE_INFO, .pNext = &sti};
  VK(b, vkCreateSemaphore(b->dev, &sci, NULL, &b->timeline));
  VkShaderModuleCreateInfo smi = {.sType = VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO, .codeSize = spirv_bytes, .pCode = spirv};
  VK(b, vkCreateShaderModule(b->dev, &smi, NULL, &b->shader));
  VkPipelineLayoutCreateInfo lci = {.sType = VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO};
  VK(b, vkCreatePipelineLayout(b->dev, &lci, NULL, &b->layout));
  VkComputePipelineCreateInfo cpi = {.sType = VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO, .layout = b->layout,
      .stage = {.sType = VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO, .stage = VK_SHADER_STAGE_COMPUTE_BIT, .module = b->shader, .pName = "main"}};
  VK(b, vkCreateComputePipelines(b->dev, VK_NULL_HANDLE, 1, &cpi, NULL, &b->pipeline));
  if (create_buffer(b, 0, VK_BUFFER_USAGE_TRANSFER_SRC_BIT | VK_BUFFER_USAGE_TRANSFER_DST_BIT) ||
      create_buffer(b, 1, VK_BUFFER_USAGE_TRANSFER_DST_BIT)) return -1;
  return 0;
}

// ------------------------------------------------------------------ the interface (ctypes)
void vkb_close(vkb *b) {
  if (!b) return;
  if (b->dev) {
    vkDeviceWaitIdle(b->dev);
    for (int i = 0; i < 2; i++) { vkDestroyBuffer(b->dev, b->buf[i], NULL); vkFreeMemory(b->dev, b->mem[i], NULL); }
    vkDestroyPipeline(b->dev, b->pipeline, NULL);
    vkDestroyPipelineLayout(b->dev, b->layout, NULL);
    vkDestroyShaderModule(b->dev, b->shader, NULL);
    vkDestroySemaphore(b->dev, b->timeline, NULL);
    vkDestroyCommandPool(b->dev, b->pool, NULL);  // frees the command buffer
    vkDestroyDevice(b->dev, NULL);
  }
  if (b->inst) vkDestroyInstance(b->inst, NULL);
  free(b);
}

// Open physical device `index` with the compute shader `spirv` and two `copy_bytes` buffers; NULL with the reason in err.
vkb *vkb_open(int index, const uint32_t *spirv, size_t spirv_bytes, uint64_t copy_bytes, char *err, size_t errlen) {
  vkb *b = calloc(1, sizeof *b);
  if (!b) { fail(err, errlen, "out of memory"); return NULL; }
  b->copy_bytes = copy_bytes;
  if (setup(b, index, spirv, spirv_bytes)) {
    snprintf(err, errlen, "%s", b->err);
    vkb_close(b);
    return NULL;
  }
  return b;
}

const char *vkb_error(vkb *b) { return b->err; }
const char *vkb_device_name(vkb *b) { return b->name; }
uint32_t vkb_copy_memory_flags(vkb *b) { return b->mem_flags; }

// Record k dispatches once, then time `reps` submit+wait round trips of them (ns each).
int vkb_time_dispatches(vkb *b, int k, int reps, double *ns_out) {
  return record_dispatches(b, k) || time_round_trips(b, reps, ns_out) ? -1 : 0;
}

// n submits of one dispatch back to back, each signalling the next timeline value, one wait for the last: total ns.
int vkb_pipelined(vkb *b, int n, double *ns_out) {
  if (record_dispatches(b, 1)) return -1;
  uint64_t t = now_ns(), v = 0;
  for (int i = 0; i < n; i++) if (submit(b, &v)) return -1;
  if (wait_value(b, v)) return -1;
  *ns_out = (double)(now_ns() - t);
  return 0;
}

// Fill the source with a pattern and copy it once (untimed; checked when the memory is host-visible), then time
// `reps` submit+wait round trips of one vkCmdCopyBuffer of the whole buffer (ns each).
int vkb_time_copy(vkb *b, int reps, double *ns_out) {
  const uint32_t pattern = 0xA5C3E1F0u;
  VkBufferCopy region = {.size = b->copy_bytes};
  VkMemoryBarrier to_copy = {.sType = VK_STRUCTURE_TYPE_MEMORY_BARRIER, .srcAccessMask = VK_ACCESS_TRANSFER_WRITE_BIT,
                             .dstAccessMask = VK_ACCESS_TRANSFER_READ_BIT},
                  to_host = {.sType = VK_STRUCTURE_TYPE_MEMORY_BARRIER, .srcAccessMask = VK_ACCESS_TRANSFER_WRITE_BIT,
                             .dstAccessMask = VK_ACCESS_HOST_READ_BIT};
  uint64_t v;
  if (begin(b)) return -1;
  vkCmdFillBuffer(b->cmd, b->buf[0], 0, VK_WHOLE_SIZE, pattern);
  vkCmdPipelineBarrier(b->cmd, VK_PIPELINE_STAGE_TRANSFER_BIT, VK_PIPELINE_STAGE_TRANSFER_BIT, 0, 1, &to_copy, 0, NULL, 0, NULL);
  vkCmdCopyBuffer(b->cmd, b->buf[0], b->buf[1], 1, &region);
  vkCmdPipelineBarrier(b->cmd, VK_PIPELINE_STAGE_TRANSFER_BIT, VK_PIPELINE_STAGE_HOST_BIT, 0, 1, &to_host, 0, NULL, 0, NULL);
  VK(b, vkEndCommandBuffer(b->cmd));
  if (submit(b, &v) || wait_value(b, v)) return -1;
  if (b->mem_flags & VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT) {
    uint32_t *p;
    VK(b, vkMapMemory(b->dev, b->mem[1], 0, VK_WHOLE_SIZE, 0, (void **)&p));
    if (!(b->mem_flags & VK_MEMORY_PROPERTY_HOST_COHERENT_BIT)) {
      VkMappedMemoryRange range = {.sType = VK_STRUCTURE_TYPE_MAPPED_MEMORY_RANGE, .memory = b->mem[1], .size = VK_WHOLE_SIZE};
      VK(b, vkInvalidateMappedMemoryRanges(b->dev, 1, &range));
    }
    size_t last = b->copy_bytes / 4 - 1;
    uint32_t first = p[0], end = p[last];
    vkUnmapMemory(b->dev, b->mem[1]);
    if (first != pattern || end != pattern)
      return fail(b->err, sizeof b->err, "vkCmdCopyBuffer check: destination holds 0x%08x..0x%08x, not 0x%08x", first, end, pattern);
  }
  if (begin(b)) return -1;
  vkCmdCopyBuffer(b->cmd, b->buf[0], b->buf[1], 1, &region);
  VK(b, vkEndCommandBuffer(b->cmd));
  return time_round_trips(b, reps, ns_out);
}
