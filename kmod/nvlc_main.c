// SPDX-License-Identifier: GPL-2.0
/*
 * nvlink_counter: the misc device /dev/nvlink_stats, its file operations and ioctls.
 * The ABI is include/uapi/linux/nvlink_counter.h; docs/kmod.md says how to use it.
 */
#include <linux/capability.h>
#include <linux/fs.h>
#include <linux/miscdevice.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/poll.h>
#include <linux/slab.h>
#include <linux/uaccess.h>

#include "nvlc.h"

/* Each open file holds about 400 KiB (its windows and its snapshot buffer). */
#define NVLC_MAX_OPEN_LIMIT 1024

static ulong period_ns = NVLC_PERIOD_DEFAULT_NS;
module_param(period_ns, ulong, 0444);
MODULE_PARM_DESC(period_ns, "sampling period in ns at load (10000..1000000000, default 100000)");

static uint max_open = 64;
module_param(max_open, uint, 0444);
MODULE_PARM_DESC(max_open, "open files of all users together (2..1024, default 64)");

static uint max_open_per_user = 4;
module_param(max_open_per_user, uint, 0444);
MODULE_PARM_DESC(max_open_per_user,
		 "open files of one user other than root (1..max_open - root_reserve, default 4)");

static uint root_reserve = 16;
module_param(root_reserve, uint, 0444);
MODULE_PARM_DESC(root_reserve,
		 "open files only root may take, so that other users cannot keep the daemon out (1..max_open - 1, default 16)");

static int nvlc_open(struct inode *inode, struct file *file)
{
	struct nvlc_file *f;
	int ret = 0;

	f = kvzalloc(sizeof(*f), GFP_KERNEL_ACCOUNT);
	if (!f)
		return -ENOMEM;
	f->snap = kvmalloc(NVLC_SNAPSHOT_MAX, GFP_KERNEL_ACCOUNT);
	if (!f->snap) {
		ret = -ENOMEM;
		goto err_free;
	}
	mutex_init(&f->read_lock);

	ret = nvlc_reader_attach(f);
	if (ret)
		goto err_free;
	file->private_data = f;
	return 0;

err_free:
	kvfree(f->snap);
	kvfree(f);
	return ret;
}

static int nvlc_release(struct inode *inode, struct file *file)
{
	struct nvlc_file *f = file->private_data;

	nvlc_reader_detach(f);
	mutex_destroy(&f->read_lock);
	kvfree(f->snap);
	kvfree(f);
	return 0;
}

/* Offset 0 takes a fresh snapshot; later offsets continue it; its end reads as EOF. */
static ssize_t nvlc_read(struct file *file, char __user *buf, size_t count, loff_t *ppos)
{
	struct nvlc_file *f = file->private_data;
	loff_t pos = *ppos;
	ssize_t ret;
	size_t n;

	if (pos < 0)
		return -EINVAL;
	if (!count)
		return 0;
	if (mutex_lock_interruptible(&f->read_lock))
		return -ERESTARTSYS;
	if (pos == 0) {
		memset(f->snap, 0, NVLC_SNAPSHOT_MAX);
		f->snap_len = 0;
		ret = nvlc_snapshot(f, f->snap, &f->snap_len);
		if (ret)
			goto out;
	}
	if (pos >= f->snap_len) {
		ret = 0;
		goto out;
	}
	n = min_t(size_t, count, f->snap_len - pos);
	if (copy_to_user(buf, f->snap + pos, n)) {
		ret = -EFAULT;
		goto out;
	}
	*ppos = pos + n;
	ret = n;
out:
	mutex_unlock(&f->read_lock);
	return ret;
}

/* Readable when a link crossed a threshold or a device went away since the last snapshot. */
static __poll_t nvlc_poll(struct file *file, poll_table *wait)
{
	struct nvlc_file *f = file->private_data;

	poll_wait(file, &nvlc_wq, wait);
	return nvlc_reader_event(f) ? EPOLLIN | EPOLLRDNORM | EPOLLPRI : 0;
}

/* Known command number: a wrong direction is another command, a wrong size is invalid. */
static int nvlc_check_cmd(unsigned int cmd, unsigned int expected)
{
	if (_IOC_DIR(cmd) != _IOC_DIR(expected))
		return -ENOTTY;
	if (_IOC_SIZE(cmd) != _IOC_SIZE(expected))
		return -EINVAL;
	return 0;
}

static long nvlc_get_version(void __user *argp)
{
	struct nvlc_version v;

	memset(&v, 0, sizeof(v));
	v.abi_version = NVLC_ABI_VERSION;
	v.header_size = sizeof(struct nvlc_header);
	v.record_size = sizeof(struct nvlc_record);
	v.max_links = NVLC_MAX_LINKS;
	v.hist_buckets = NVLC_HIST_BUCKETS;
	v.num_counters = NVLC_NUM_COUNTERS;
	return copy_to_user(argp, &v, sizeof(v)) ? -EFAULT : 0;
}

static long nvlc_get_params(void __user *argp)
{
	struct nvlc_params p;
	unsigned long flags;

	memset(&p, 0, sizeof(p));
	spin_lock_irqsave(&nvlc_lock, flags);
	p.period_ns = nvlc_period_ns;
	p.stall_threshold = nvlc_stall_threshold;
	p.util_threshold = nvlc_util_threshold;
	spin_unlock_irqrestore(&nvlc_lock, flags);
	return copy_to_user(argp, &p, sizeof(p)) ? -EFAULT : 0;
}

static long nvlc_set_params(void __user *argp)
{
	struct nvlc_params p;
	unsigned long flags;

	if (copy_from_user(&p, argp, sizeof(p)))
		return -EFAULT;
	if (memchr_inv(p.reserved, 0, sizeof(p.reserved)))
		return -EINVAL;
	if (p.period_ns < NVLC_PERIOD_MIN_NS || p.period_ns > NVLC_PERIOD_MAX_NS)
		return -EINVAL;
	if (!p.stall_threshold || p.stall_threshold > NVLC_MAX_STALL_THRESHOLD)
		return -EINVAL;
	if (!p.util_threshold || p.util_threshold > NVLC_MAX_UTIL_THRESHOLD)
		return -EINVAL;
	spin_lock_irqsave(&nvlc_lock, flags);
	/* The timer takes the new period at its next expiry. */
	WRITE_ONCE(nvlc_period_ns, p.period_ns);
	nvlc_stall_threshold = p.stall_threshold;
	nvlc_util_threshold = p.util_threshold;
	spin_unlock_irqrestore(&nvlc_lock, flags);
	return 0;
}

static int nvlc_check_sim_link(const struct nvlc_sim_link *l)
{
	unsigned int c;

	if (l->reserved0 || memchr_inv(l->reserved, 0, sizeof(l->reserved)))
		return -EINVAL;
	if (l->device >= NVLC_MAX_LINKS || l->link >= NVLC_MAX_LINKS)
		return -EINVAL;
	if (!l->capacity_bps || l->capacity_bps > NVLC_MAX_CAPACITY_BPS)
		return -EINVAL;
	for (c = 0; c < NVLC_NUM_COUNTERS; c++)
		if (l->rate[c] > NVLC_MAX_SIM_RATE)
			return -EINVAL;
	if (l->burst_pct < 100 || l->burst_pct > NVLC_MAX_BURST_PCT)
		return -EINVAL;
	if (l->burst_period_ns > NVLC_PERIOD_MAX_NS * 1000ULL)
		return -EINVAL;
	if (l->burst_len_ns > l->burst_period_ns)
		return -EINVAL;
	return 0;
}

static struct nvlc_state *nvlc_state_alloc(u32 nlinks)
{
	struct nvlc_state *s = kzalloc(sizeof(*s), GFP_KERNEL);

	if (!s)
		return NULL;
	s->links = kvcalloc(nlinks, sizeof(*s->links), GFP_KERNEL);
	if (!s->links) {
		kfree(s);
		return NULL;
	}
	return s;
}

static void nvlc_install(struct nvlc_state *s)
{
	struct nvlc_state *old;

	old = nvlc_swap_state(s);
	nvlc_state_free(old);
}

static long nvlc_set_sim(void __user *argp)
{
	struct nvlc_sim_link *links;
	struct nvlc_sim_config cfg;
	struct nvlc_state *s;
	u32 i, j;
	long ret;

	if (copy_from_user(&cfg, argp, sizeof(cfg)))
		return -EFAULT;
	if (cfg.reserved0 || memchr_inv(cfg.reserved, 0, sizeof(cfg.reserved)))
		return -EINVAL;
	if (!cfg.nlinks || cfg.nlinks > NVLC_MAX_LINKS)
		return -EINVAL;
	links = memdup_user(u64_to_user_ptr(cfg.links), cfg.nlinks * sizeof(*links));
	if (IS_ERR(links))
		return PTR_ERR(links);
	for (i = 0; i < cfg.nlinks; i++) {
		ret = nvlc_check_sim_link(&links[i]);
		if (ret)
			goto err_links;
		for (j = 0; j < i; j++) {
			if (links[j].device == links[i].device && links[j].link == links[i].link) {
				ret = -EINVAL;
				goto err_links;
			}
		}
	}
	s = nvlc_state_alloc(cfg.nlinks);
	if (!s) {
		ret = -ENOMEM;
		goto err_links;
	}
	s->source = NVLC_SOURCE_SIM;
	s->nlinks = cfg.nlinks;
	for (i = 0; i < cfg.nlinks; i++) {
		s->links[i].device = links[i].device;
		s->links[i].link = links[i].link;
		s->links[i].capacity = links[i].capacity_bps;
		s->links[i].sim = links[i];
	}
	kfree(links);
	mutex_lock(&nvlc_cfg_mutex);
	nvlc_install(s);
	mutex_unlock(&nvlc_cfg_mutex);
	return 0;

err_links:
	kfree(links);
	return ret;
}

static long nvlc_set_mmio(void __user *argp)
{
	struct nvlc_mmio_link *links = NULL;
	struct nvlc_mmio_reg *regs = NULL;
	struct nvlc_mmio_config cfg;
	struct nvlc_state *s;
	long ret;

	if (copy_from_user(&cfg, argp, sizeof(cfg)))
		return -EFAULT;
	if (memchr_inv(cfg.reserved, 0, sizeof(cfg.reserved)))
		return -EINVAL;
	if (!cfg.nlinks || cfg.nlinks > NVLC_MAX_LINKS || !cfg.nregs || cfg.nregs > NVLC_MAX_REGS)
		return -EINVAL;
	links = memdup_user(u64_to_user_ptr(cfg.links), cfg.nlinks * sizeof(*links));
	if (IS_ERR(links))
		return PTR_ERR(links);
	regs = vmemdup_user(u64_to_user_ptr(cfg.regs), cfg.nregs * sizeof(*regs));
	if (IS_ERR(regs)) {
		ret = PTR_ERR(regs);
		goto err_links;
	}
	s = nvlc_state_alloc(cfg.nlinks);
	if (!s) {
		ret = -ENOMEM;
		goto err_regs;
	}
	/* Under the mutex: the PCI notifier must not miss a device mapped meanwhile. */
	mutex_lock(&nvlc_cfg_mutex);
	ret = nvlc_mmio_build(links, cfg.nlinks, regs, cfg.nregs, s);
	if (ret) {
		mutex_unlock(&nvlc_cfg_mutex);
		nvlc_state_free(s);
		goto err_regs;
	}
	nvlc_install(s);
	mutex_unlock(&nvlc_cfg_mutex);
	ret = 0;
err_regs:
	kvfree(regs);
err_links:
	kfree(links);
	return ret;
}

static long nvlc_clear_source(void)
{
	mutex_lock(&nvlc_cfg_mutex);
	nvlc_install(NULL);
	mutex_unlock(&nvlc_cfg_mutex);
	return 0;
}

static long nvlc_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	void __user *argp = (void __user *)arg;
	unsigned int expected;
	bool admin = true;
	int ret;

	if (_IOC_TYPE(cmd) != NVLC_IOC_MAGIC)
		return -ENOTTY;
	switch (_IOC_NR(cmd)) {
	case _IOC_NR(NVLC_IOC_GET_VERSION):
		expected = NVLC_IOC_GET_VERSION;
		admin = false;
		break;
	case _IOC_NR(NVLC_IOC_GET_PARAMS):
		expected = NVLC_IOC_GET_PARAMS;
		admin = false;
		break;
	case _IOC_NR(NVLC_IOC_SET_PARAMS):
		expected = NVLC_IOC_SET_PARAMS;
		break;
	case _IOC_NR(NVLC_IOC_SET_SIM):
		expected = NVLC_IOC_SET_SIM;
		break;
	case _IOC_NR(NVLC_IOC_SET_MMIO):
		expected = NVLC_IOC_SET_MMIO;
		break;
	case _IOC_NR(NVLC_IOC_CLEAR_SOURCE):
		expected = NVLC_IOC_CLEAR_SOURCE;
		break;
	default:
		return -ENOTTY;
	}
	ret = nvlc_check_cmd(cmd, expected);
	if (ret)
		return ret;
	if (admin && !capable(CAP_SYS_ADMIN))
		return -EPERM;

	switch (expected) {
	case NVLC_IOC_GET_VERSION:
		return nvlc_get_version(argp);
	case NVLC_IOC_GET_PARAMS:
		return nvlc_get_params(argp);
	case NVLC_IOC_SET_PARAMS:
		return nvlc_set_params(argp);
	case NVLC_IOC_SET_SIM:
		return nvlc_set_sim(argp);
	case NVLC_IOC_SET_MMIO:
		return nvlc_set_mmio(argp);
	default:
		return nvlc_clear_source();
	}
}

static const struct file_operations nvlc_fops = {
	.owner = THIS_MODULE,
	.open = nvlc_open,
	.release = nvlc_release,
	.read = nvlc_read,
	.poll = nvlc_poll,
	.llseek = default_llseek,
	.unlocked_ioctl = nvlc_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
};

/*
 * Figures about the module itself in /sys/class/misc/nvlink_stats/: how many files are open,
 * and what sampling costs (samples taken and the time the timer spent taking them, whose
 * ratio is the cost of one sample: it must not grow with the number of readers).
 */
static ssize_t open_files_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	return sysfs_emit(buf, "%u\n", nvlc_open_files());
}
static DEVICE_ATTR_RO(open_files);

static ssize_t samples_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	u64 samples, busy_ns;

	nvlc_sampler_stats(&samples, &busy_ns);
	return sysfs_emit(buf, "%llu\n", samples);
}
static DEVICE_ATTR_RO(samples);

static ssize_t sample_busy_ns_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	u64 samples, busy_ns;

	nvlc_sampler_stats(&samples, &busy_ns);
	return sysfs_emit(buf, "%llu\n", busy_ns);
}
static DEVICE_ATTR_RO(sample_busy_ns);

static struct attribute *nvlc_attrs[] = {
	&dev_attr_open_files.attr,
	&dev_attr_samples.attr,
	&dev_attr_sample_busy_ns.attr,
	NULL,
};
ATTRIBUTE_GROUPS(nvlc);

/*
 * World-readable on purpose: reading is bounded per user (max_open_per_user) and root keeps a
 * reserve of open files (root_reserve), so readers cannot keep the daemon out; configuration
 * needs CAP_SYS_ADMIN. A site that wants fewer readers narrows the mode with a udev rule.
 */
static struct miscdevice nvlc_misc = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = "nvlink_stats",
	.fops = &nvlc_fops,
	.groups = nvlc_groups,
	.mode = 0444,
};

static int __init nvlc_init(void)
{
	struct nvlc_limits limits;
	int ret;

	BUILD_BUG_ON(sizeof(struct nvlc_header) % 8 || sizeof(struct nvlc_record) % 8);
	BUILD_BUG_ON(ARRAY_SIZE(((struct nvlc_record *)0)->counters) != NVLC_NUM_COUNTERS);
	BUILD_BUG_ON(ARRAY_SIZE(((struct nvlc_record *)0)->window_max_delta) != NVLC_NUM_COUNTERS);
	BUILD_BUG_ON(ARRAY_SIZE(((struct nvlc_sim_link *)0)->rate) != NVLC_NUM_COUNTERS);
	BUILD_BUG_ON(ARRAY_SIZE(((struct nvlc_record *)0)->util_hist) != NVLC_HIST_BUCKETS);
	BUILD_BUG_ON(ARRAY_SIZE(((struct nvlc_record *)0)->window_stall_hist) != NVLC_HIST_BUCKETS);
	BUILD_BUG_ON(NVLC_SNAPSHOT_MAX > INT_MAX);

	if (period_ns < NVLC_PERIOD_MIN_NS || period_ns > NVLC_PERIOD_MAX_NS) {
		pr_err("nvlink_counter: period_ns=%lu outside %u..%u\n", period_ns,
		       NVLC_PERIOD_MIN_NS, NVLC_PERIOD_MAX_NS);
		return -EINVAL;
	}
	if (max_open < 2 || max_open > NVLC_MAX_OPEN_LIMIT || !root_reserve ||
	    root_reserve >= max_open || !max_open_per_user ||
	    max_open_per_user > max_open - root_reserve) {
		pr_err("nvlink_counter: need 2 <= max_open (%u) <= %u, 1 <= root_reserve (%u) < max_open, 1 <= max_open_per_user (%u) <= max_open - root_reserve\n",
		       max_open, NVLC_MAX_OPEN_LIMIT, root_reserve, max_open_per_user);
		return -EINVAL;
	}
	limits.max_open = max_open;
	limits.max_open_per_user = max_open_per_user;
	limits.root_reserve = root_reserve;
	ret = nvlc_readers_init(&limits);
	if (ret)
		return ret;
	ret = nvlc_mmio_notifier_register();
	if (ret)
		goto err_readers;
	nvlc_sampler_start(period_ns);
	ret = misc_register(&nvlc_misc);
	if (ret)
		goto err_sampler;
	pr_info("nvlink_counter: /dev/%s, ABI %u.%u, period %lu ns, open files %u (%u per user, %u for root only)\n",
		nvlc_misc.name, NVLC_ABI_MAJOR, NVLC_ABI_MINOR, period_ns, max_open,
		max_open_per_user, root_reserve);
	return 0;

err_sampler:
	nvlc_sampler_stop();
	nvlc_mmio_notifier_unregister();
err_readers:
	nvlc_readers_exit();
	return ret;
}

static void __exit nvlc_exit(void)
{
	/* No file can be open here: each holds a reference on the module (fops.owner). */
	misc_deregister(&nvlc_misc);
	nvlc_sampler_stop();
	nvlc_mmio_notifier_unregister();
	mutex_lock(&nvlc_cfg_mutex);
	nvlc_install(NULL);
	mutex_unlock(&nvlc_cfg_mutex);
	nvlc_readers_exit();
}

module_init(nvlc_init);
module_exit(nvlc_exit);

MODULE_DESCRIPTION("High-rate sampling of NVLink-style per-link counters (sim and mmio sources)");
MODULE_AUTHOR("nodescope");
MODULE_LICENSE("GPL");
MODULE_VERSION("1.0.0");
