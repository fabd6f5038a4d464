"""What runs inside the sandbox: the child interpreter `sandbox.run` starts for one run.

`sandbox.run` starts this file as `python -I sandbox_child.py DIR LIMITS` (DIR: the run's temp
dir, holding the job; LIMITS: a `SandboxLimits` as JSON). It confines itself in the layers
below, runs the program in a process of its own and exits with its status; with a `Check`
its runner calls the program's function for the tests, over pipes. `-I` leaves this file's
directory off sys.path, so neither this file nor the program can import the project's
modules: everything the child runs is here, and sandbox.py imports from here what both sides
share (`SandboxLimits`, JOB_NAME, LAYERS_TAG, TIMEOUT_EXIT), never the reverse. How a run ends
and is judged, and the limits of the design as a whole, are in sandbox.py's docstring.

Layers, in the order the child applies them, each only where the host allows it:
1. namespaces: a new network namespace (no interface is up, loopback included, so no
   connection leaves it), a new PID namespace (when its first process exits the kernel
   kills everything left in it, including processes that left the OS process group with
   setsid) and a new mount namespace with a root of the program's own ("rootfs"): a small
   tmpfs holding read-only binds of the interpreter's standard library and the system's
   shared libraries (`_readable_paths`), four devices, the PID namespace's /proc and, at
   the temp dir's path, a size-limited tmpfs (the disk cannot fill up, and its files vanish
   with the namespace). Init pivots into it (pivot_root(2)) and lets the host's root go
   before the program exists, so the data, the repository, the rest of /tmp, /etc and
   every home are not there to be read or listed. A caller that is not root first enters
   a new user namespace, mapping its own uid;
2. rlimits per process: CPU seconds, address space, file size, open files, processes
   (set after the user namespace exists: in it the process count is the sandbox's own);
   no core dumps; no_new_privs;
3. as root: the program runs under an unprivileged uid unique to this run, because the
   kernel does not enforce RLIMIT_NPROC for root;
4. Landlock (Linux >= 5.13): files may be read, listed or executed only beneath the temp
   dir, `_readable_paths`, the devices and (with layer 1) /proc ("landlock-read"), and
   created, written or removed only beneath the temp dir (and /dev/null written); TCP
   bind/connect denied (Landlock ABI >= 4); no signals to, and no abstract unix socket
   connections with, processes outside the sandbox (ABI >= 6). Its read, network and
   signal rules repeat layer 1 on purpose: where namespaces are missing they still keep
   the program away from the host's files, off the network and away from the caller's
   processes. Its write rule is the only bound on where a program that runs under the
   caller's own uid (a caller that is not root) may write;
5. every capability dropped: in a user namespace the program would hold all of them in it
   (mount, umount, ptrace of the runner);
6. only where neither layer 1's root nor Landlock confines reads: a Python audit hook
   (`_audit_reads`, "audit-reads") refuses opening, listing or entering paths outside those
   of layer 4, starting a process and every ctypes call.

A `Check` (HumanEval's check(candidate), `reward.code_reward`; sandbox.py's docstring, "Ending
and judging a run" 4): the tests run apart from the program. The runner forks the program's process before it reads the
nonce, and that process serves calls of the entry point over a pipe, arguments and
return values as plain data (JSON of builtin types, tagged by type; a subclass goes
as its base type's value). The tests, and HumanEval's prompt they may use, run in the
runner's process, where no line of the program ever runs: a return value rigged to
equal anything (a class whose __eq__ returns True) is refused as not plain data, an
int subclass with such an __eq__ arrives as its plain int value, redefining `check`, the
prompt's helpers or builtins changes nothing the tests see, exiting early (sys.exit,
os._exit, SystemExit raised in the function) ends only the program's process, and
neither the nonce nor the test source (its expected values) is ever in the program's
memory: both reach the runner on stdin after the fork. The runner is not dumpable and
the program's process drops every capability, so it cannot read the runner's memory
or its stdin (/proc/PID/mem, /proc/PID/fd/0, ptrace); the processes above the runner
close their stdin once the pipe has passed on.

Limits of the confinement and of a Check (sandbox.py's docstring has the rest):
1. Reads: the program reads its temp dir, the standard library and the system's shared
   library directories (other software's files there, none of the run's). Where the host
   has neither user namespaces (or root) nor Landlock, only the audit hook guards reads,
   and it sees Python's calls only: C code that reads without an audit event (an exec by
   _posixsubprocess.fork_exec, say) gets past it.
2. Without a `Check`, code written against this file's internals (reading the nonce
   from the runner's stack) is not stopped; with one, the nonce is not in its process.
3. With a `Check`: tests that catch every exception (a bare `except:`) also catch the
   runner's refusal of a rigged value; a function whose result is a custom class
   instance (other than a builtin's subclass), a generator, or that mutates its
   arguments for the test to inspect cannot
   be tested this way (values cross as plain data only); the runner's imports could be
   shadowed by files the program writes where nothing confines its writes (no Landlock,
   a caller that is not root).
"""

from __future__ import annotations

import builtins
import ctypes
import json
import os
import resource
import signal
import sys
import sysconfig
from dataclasses import dataclass

# Kernel constants from <linux/sched.h>, <linux/mount.h> and <linux/prctl.h>, spelled out because the os module
# has no mount(2) at all, and unshare and its flags only from Python 3.12.
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 1 << 18
MNT_DETACH = 2  # umount2(2): detach now, free once no longer busy
# A read-only remount of a bind mount must repeat the flags the kernel locked on it in a user namespace
# (mount_namespaces(7)), read back by statvfs(2): its ST_ bits -> mount(2)'s MS_ bits
LOCKED_MOUNT_FLAGS = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC,
                      os.ST_NOATIME: 1 << 10, os.ST_NODIRATIME: 1 << 11, os.ST_RELATIME: 1 << 21}
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
LINUX_CAPABILITY_VERSION_3 = 0x20080522  # <linux/capability.h>: capset(2) with two 32-bit words per set
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446  # same on every arch
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1  # the first flag asks for the ABI version only
# Landlock filesystem rights that change the filesystem (uapi/linux/landlock.h), with the ABI that added them;
# reading and executing are restricted apart (FS_READ): allowed beneath the standard library and the shared libraries
FS_WRITE_RIGHTS = {1: (1 << 1) | (1 << 4) | (1 << 5) | sum(1 << b for b in range(6, 13)), 2: 1 << 13, 3: 1 << 14}
FS_WRITE_FILE, FS_TRUNCATE = 1 << 1, 1 << 14
FS_READ = (1 << 0) | (1 << 2) | (1 << 3)  # execute, read a file, list a directory (ABI 1)
FS_FILE_RIGHTS = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 14)  # the rights a rule on a file (not a directory) may hold
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2  # Landlock ABI >= 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2  # Landlock ABI >= 6
SANDBOX_UID_BASE = 1_000_000_000  # above any real account; + the child's pid makes it unique among live runs
TIMEOUT_EXIT = 124  # the child's exit code when it hit the wall-clock limit (as coreutils' timeout)
LAYERS_TAG = "#sandbox-layers "  # the output's first line names the layers applied, before any program output
JOB_NAME = "job.json"  # the program and the name of the function a Check calls, handed to the child
PLAIN_SCALARS = (bool, int, float, str, type(None))  # JSON's own types, which the runner takes exactly
# What a program may read besides its temp dir: the standard library (sysconfig's paths, found at run time) and
# the shared libraries its extension modules load lazily (hashlib's libcrypto), with the loader's cache
LIBRARY_PATHS = ("/lib", "/lib64", "/lib32", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/local/lib",
                 "/etc/ld.so.cache")
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")  # readable; only /dev/null writable
ROOT_TMPFS_OPTS = b"size=1m,mode=0755"  # the program's / holds only directories, mount points and symlinks
# `_audit_reads`: events whose first argument is a path (sys.audit's event table), and event prefixes refused
AUDIT_PATH_EVENTS = ("open", "os.listdir", "os.scandir", "os.chdir")
AUDIT_REFUSED = ("os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen", "ctypes.")


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run: this file applies them, `sandbox.run` takes them."""
    wall_s: float = 10.0  # from the child's start; the parent allows sandbox.PARENT_GRACE_S more
    cpu_s: int = 5  # per process
    memory_mb: int = 512  # address space per process
    max_processes: int = 8  # tasks (processes and threads) of the sandbox uid
    file_mb: int = 16  # largest file the program may write, its output included
    disk_mb: int = 64  # size of the tmpfs working directory
    open_files: int = 64


# ----------------------------------------------------------------------------- confinement, then the program

def _libc():
    return ctypes.CDLL(None, use_errno=True)  # the interpreter's own libc; use_errno lets _check report why


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def _enter_namespaces(libc, tmp: str, uid: int, limits: SandboxLimits) -> list[str]:
    """New net, PID and mount namespaces (and user namespace when not root), and the program's root
    built over tmp (`_build_root`), which init pivots into (`_pivot_root`)."""
    root = os.geteuid() == 0
    # root may create these namespaces directly; any other caller may only together with a new user namespace
    flags = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS | (0 if root else CLONE_NEWUSER)
    try:
        _check(libc.unshare(flags), "unshare")
    except OSError:  # e.g. unprivileged user namespaces disabled, or a container's seccomp policy
        return []
    if not root:  # map our own ids, or file creation fails with EOVERFLOW
        # setgroups must be denied before an unprivileged process may write gid_map (user_namespaces(7))
        gid = os.getgid()
        for name, text in (("setgroups", "deny"), ("uid_map", f"{os.getuid()} {os.getuid()} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    # keep our mounts out of the host's namespace
    _check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    _build_root(libc, tmp, uid, limits)
    return ["netns", "pidns", "tmpfs", "rootfs"] + ([] if root else ["userns"])


def _readable_paths() -> list[str]:
    """The paths a program may read besides its temp dir (LIBRARY_PATHS' comment), none inside another."""
    # the base interpreter's, not a virtual environment's (its site-packages are the project's dependencies)
    base = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})
    # LIBDIR: the libraries a conda or pyenv interpreter links its extension modules to (conda's libssl, libffi)
    found = [base["stdlib"], base["platstdlib"], *map(sysconfig.get_config_var, ("DESTSHARED", "LIBDIR"))]
    paths = sorted({os.path.abspath(p) for p in [*found, *LIBRARY_PATHS] if p and os.path.lexists(p)})
    return [p for p in paths if not any(p.startswith(q + os.sep) for q in paths)]


def _build_root(libc, tmp: str, uid: int, limits: SandboxLimits):
    """The program's future /: a small tmpfs mounted over tmp holding read-only binds of `_readable_paths`
    and DEVICES at their own paths, an empty /proc, and at tmp's path the program's working directory, a
    size-limited tmpfs. The data, the repository, the rest of /tmp, /etc and every home are not in it.

    Directories on the way to a bind are this tmpfs's own, mode 0755: the sandbox uid (as root) reaches an
    interpreter under /root without the rest of /root becoming visible.
    """
    _check(libc.mount(b"tmpfs", tmp.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, ROOT_TMPFS_OPTS), "mount the root tmpfs")
    for path in [*_readable_paths(), *DEVICES]:
        inside = tmp + path
        if os.path.islink(path):  # /lib -> usr/lib on a merged /usr: the same link, its target bound on its own
            os.makedirs(os.path.dirname(inside), exist_ok=True)
            os.symlink(os.readlink(path), inside)
            continue
        if os.path.isdir(path):  # a bind mount needs a mount point of the same kind
            os.makedirs(inside, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(inside), exist_ok=True)
            open(inside, "w").close()
        _check(libc.mount(path.encode(), inside.encode(), None, MS_BIND | MS_REC, None), f"bind {path}")
        if path not in DEVICES:  # a device node on a read-only mount could not be written, /dev/null included
            _remount_read_only(libc, inside)
    os.makedirs(tmp + "/proc")
    os.makedirs(tmp + tmp)
    # owned by the uid the program will run under, readable by no one else; nosuid and nodev: no setuid binary
    # or device node the program creates there has any effect
    opts = f"size={limits.disk_mb}m,mode=0700,uid={uid},gid={uid}".encode()
    # The root itself stays writable, to its owner only (the caller's uid; never the sandbox uid of a root
    # caller): a throwaway tmpfs of 1 MB, where Landlock refuses writes anyway
    _check(libc.mount(b"tmpfs", (tmp + tmp).encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts), "mount tmpfs")


def _remount_read_only(libc, path: str):
    """Make the mount at path read-only, keeping the flags a user namespace locked on it."""
    kept = sum(ms for st, ms in LOCKED_MOUNT_FLAGS.items() if os.statvfs(path).f_flag & st)
    _check(libc.mount(None, path.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept, None), f"remount {path} ro")


def _pivot_root(libc, new: str):
    """Make `new` this mount namespace's / and let go of the old one (pivot_root(2)'s "." "." idiom)."""
    os.chdir(new)
    _check(libc.pivot_root(b".", b"."), "pivot_root")  # the old root now lies on top of the new one
    _check(libc.umount2(b".", MNT_DETACH), "detach the old root")  # no path leads back to it
    os.chdir("/")


def _landlock(libc, tmp: str, *, proc: bool) -> list[str]:
    """Allow filesystem writes only beneath tmp, reads only there and beneath `_readable_paths` (and /proc when
    `proc`: the PID namespace's own); deny TCP and outside signals where the ABI has them."""
    libc.syscall.restype = ctypes.c_long  # syscall(2) returns a long; ctypes would assume an int
    # a kernel without Landlock, or with it disabled at boot, returns -1 (ENOSYS, EOPNOTSUPP): no layer, not an error
    abi = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    if abi < 1:
        return []

    # struct landlock_ruleset_attr of the newest ABI; an older kernel accepts the longer struct as long as the
    # fields it does not know are zero, which the ABI checks below ensure
    class RulesetAttr(ctypes.Structure):
        _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                    ("scoped", ctypes.c_uint64)]

    class PathBeneath(ctypes.Structure):
        _pack_ = 1  # struct landlock_path_beneath_attr is __attribute__((packed)) in the uapi header
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    # a handled right is denied everywhere except beneath the paths of a rule; a right this ABI does not know
    # would make the kernel refuse the whole ruleset
    fs = sum(bits for v, bits in FS_WRITE_RIGHTS.items() if v <= abi) | FS_READ
    attr = RulesetAttr(fs, NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0,
                       SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0)
    ruleset = _check(libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
                                  ctypes.c_uint32(0)), "landlock_create_ruleset")
    # /dev/null: programs and the libraries they call write there; opening it with O_TRUNC needs TRUNCATE (ABI 3)
    # (rules on one path add up)
    rules = [(tmp, fs), ("/dev/null", FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0))]
    rules += [(path, FS_READ) for path in [*_readable_paths(), *DEVICES] + (["/proc"] if proc else [])]
    for path, access in rules:
        if not os.path.exists(path):  # a link whose target is missing: O_PATH would fail the whole layer
            continue
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = PathBeneath(access if os.path.isdir(path) else access & FS_FILE_RIGHTS, fd)  # else EINVAL
        _check(libc.syscall(SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                            ctypes.byref(rule), ctypes.c_uint32(0)), "landlock_add_rule")
        os.close(fd)
    # from here on for this process and every process it starts; it cannot be lifted (needs no_new_privs, set earlier)
    _check(libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)), "landlock_restrict_self")
    os.close(ruleset)
    return (["landlock-fs", "landlock-read"] + (["landlock-tcp"] if abi >= 4 else [])
            + (["landlock-signal"] if abi >= 6 else []))


def _child(tmp: str, limits: SandboxLimits):
    """Confine this process, then run tmp's job in a grandchild; exit with its status."""
    libc = _libc()
    with open(os.path.join(tmp, JOB_NAME)) as f:
        job = json.load(f)  # read now: the tmpfs mounted over tmp hides the file
    root = os.geteuid() == 0
    # a uid of its own per run: processes of one uid may signal and ptrace each other, so concurrent runs
    # sharing a uid could kill or read each other
    uid = SANDBOX_UID_BASE + os.getpid() if root else os.getuid()
    layers = _enter_namespaces(libc, tmp, uid, limits)
    if root and "tmpfs" not in layers:  # the program writes into the host's temp dir instead, as the sandbox uid
        os.chown(tmp, uid, uid)
    mb = 1 << 20
    # set here, inherited by init and the program: a loop meets the CPU limit, a memory bomb the address space,
    # a fork bomb the process count; no core dumps: a crash writes no core file nor feeds the host's core handler
    for res, value in ((resource.RLIMIT_CPU, limits.cpu_s), (resource.RLIMIT_AS, limits.memory_mb * mb),
                       (resource.RLIMIT_FSIZE, limits.file_mb * mb), (resource.RLIMIT_NOFILE, limits.open_files),
                       (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, limits.max_processes)):
        # CPU: the soft limit sends SIGXCPU (a readable reason); the hard one, a second later, SIGKILL
        resource.setrlimit(res, (value, value + 1 if res == resource.RLIMIT_CPU else value))
    # no setuid binary can give the program privileges back; Landlock also requires it of an unprivileged process
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    layers.append("rlimits")
    init = os.fork()  # with a PID namespace: its init, which outlives the program and takes everything with it
    if init == 0:
        if "rootfs" in layers:  # mounted by init, the namespace's first process: a /proc of this PID namespace
            try:  # only the sandbox's own processes are listed
                _check(libc.mount(b"proc", f"{tmp}/proc".encode(), b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None),
                       "mount /proc")
            except OSError:  # refused in a user namespace where a container masks parts of the host's /proc:
                pass  # /proc stays an empty directory
            _pivot_root(libc, tmp)  # before the program exists: no process of the sandbox ever sees the host's /
        # the program is not the namespace's pid 1, which the kernel shields from every signal it has no handler
        # for (pid_namespaces(7)); init waits for it and passes its status on
        program = os.fork()
        if program != 0:
            os.close(0)  # the nonce's pipe is the program's alone: nothing may read it through /proc/PID/fd/0
        else:
            if root:  # in this order: once the uid is dropped, supplementary groups and gid can no longer change
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                layers.append("uid")
            try:
                layers += _landlock(libc, tmp, proc="rootfs" in layers)
            except OSError:  # Landlock is one layer among several; the result lists the layers that held
                pass
            # in a user namespace the program would hold every capability in it: mount, umount, ptrace of the
            # runner (after setuid, as root, it holds none already)
            _drop_capabilities(libc)
            if not {"rootfs", "landlock-read"} & set(layers):  # the kernel confines no reads: Python's hook must
                layers.append("audit-reads")
            os.chdir(tmp)  # relative paths land in the tmpfs
            _run_program(job["program"], job["entry_point"], layers)
        # os._exit, not sys.exit: a forked interpreter must not run the parent's exit handlers or flush its buffers
        os._exit(_status(os.waitpid(program, 0)[1]))
    os.close(0)  # as init above: only the program keeps the nonce's pipe
    # The wall-clock limit is kept here, outside the namespace: killing its init and reaping it returns
    # only once the kernel has killed and released every process in it, so nothing outlives this exit.
    timed_out = []

    def on_alarm(_signum, _frame):
        timed_out.append(True)
        os.kill(init, signal.SIGKILL)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limits.wall_s)
    status = _status(os.waitpid(init, 0)[1])
    os._exit(TIMEOUT_EXIT if timed_out else status)


def _status(wait_status: int) -> int:  # a shell's convention: the exit code, or 128 + n for signal n
    return os.WEXITSTATUS(wait_status) if os.WIFEXITED(wait_status) else 128 + os.WTERMSIG(wait_status)


def _run_program(source: str, entry_point: str | None, layers: list[str]):
    sys.stdout.write(LAYERS_TAG + ",".join(layers) + "\n")
    sys.stdout.flush()  # the header must come before anything the program writes
    audit = "audit-reads" in layers
    if entry_point is not None:
        _run_check(source, entry_point, audit)  # exits
    nonce = sys.stdin.readline().strip()  # stdin is at its end afterwards: the program reads nothing of it
    if audit:  # last: this process makes no ctypes call after it
        _audit_reads(os.getcwd())
    try:
        # fresh globals named __main__, as `python program.py` would give: the program's __main__ blocks
        # run, and this file's names are not among its globals
        exec(compile(source, "program.py", "exec"), {"__name__": "__main__"})
    except BaseException as e:  # SystemExit included: exiting before the end is not a pass
        _fail(e)
    _pass(nonce)


def _audit_reads(tmp: str):
    """The fallback where the kernel confines no reads: a sys.addaudithook(3.8) hook, which Python code
    cannot remove, refuses opening, listing or entering a path outside tmp and `_readable_paths`, starting
    a process (exec, spawn, system, subprocess) and every ctypes call, so no C function is called past it.
    It does not see C code that reads files without an audit event (_posixsubprocess.fork_exec, say)."""
    allowed = tuple(os.path.realpath(p) for p in [tmp, *_readable_paths(), *DEVICES])

    def hook(event: str, args: tuple):
        if event.startswith(AUDIT_REFUSED):
            raise PermissionError(f"sandbox: {event} refused")
        if event in AUDIT_PATH_EVENTS and not isinstance(args[0], int):  # an int: a descriptor already open
            path = os.path.realpath(os.fsdecode("." if args[0] is None else args[0]))
            if not any(path == a or path.startswith(a + os.sep) for a in allowed):
                raise PermissionError(f"sandbox: {event} of {path} refused")

    sys.addaudithook(hook)


def _fail(e: BaseException):
    sys.stdout.flush()
    sys.stderr.write(f"\n{type(e).__name__}: {e}"[:1000] + "\n")
    sys.stderr.flush()
    os._exit(1)


def _pass(nonce: str):
    sys.stdout.write(f"\n{nonce}\n")  # on a line of its own, even after output with no final newline
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: nothing the program registered (atexit, finalizers) prints after the nonce


# ----------------------------------------------------------------------------- a Check: tests apart from the program

class NotPlainData(BaseException):
    """The program's function returned something other than plain data. A BaseException, so a test's
    `except Exception` around a call (one that expects an error) cannot take the refusal for a pass."""


class ProgramEnded(BaseException):
    """The program's process ended (exited, crashed, failed to define the function) before answering."""


def _run_check(source: str, entry_point: str, audit: bool):
    """Fork the program's process, then read the Check's tests from stdin and run them here; exits.
    audit: the program's process installs `_audit_reads` before the program runs."""
    libc = _libc()
    # not dumpable: a process of the same uid may not read this one's memory or file descriptors (the nonce's
    # pipe) through /proc or ptrace; set before the fork so there is no moment when the program could
    _check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(DUMPABLE)")
    sys.set_int_max_str_digits(0)  # an exact big integer answer crosses the pipe as JSON digits (both processes)
    calls_r, calls_w = os.pipe()
    replies_r, replies_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the program's process: no line of the program has run yet
        os.close(calls_w)
        os.close(replies_r)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the nonce's pipe, gone before the program starts
        _check(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(DUMPABLE)")  # its own /proc stays readable to it
        if audit:  # last: this process makes no ctypes call after it
            _audit_reads(os.getcwd())
        _serve(source, entry_point, calls_r, replies_w)
    os.close(calls_r)
    os.close(replies_w)
    nonce = sys.stdin.readline().strip()
    tests = json.loads(sys.stdin.readline())
    calls, replies = os.fdopen(calls_w, "w"), os.fdopen(replies_r, "r")
    error = None
    try:
        namespace = {"__name__": "__main__"}
        try:
            context = compile(tests["context"], "prompt.py", "exec")
        except SyntaxError:  # a prompt that is not code on its own: the tests get only their own names
            context = compile("", "prompt.py", "exec")
        exec(context, namespace)
        # the tests may name the function itself, not only `candidate` (HumanEval/33 does): both are the program's
        namespace[entry_point] = candidate = _remote(entry_point, calls, replies)
        exec(compile(tests["test"], "test.py", "exec"), namespace)
        namespace["check"](candidate)
    except BaseException as e:  # AssertionError, NotPlainData, ProgramEnded, SystemExit, ...
        error = e
    os.kill(pid, signal.SIGKILL)  # before the verdict: nothing the program does can follow the nonce
    os.waitpid(pid, 0)
    if error is not None:
        _fail(error)
    _pass(nonce)


def _drop_capabilities(libc):
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    # all sets empty; with no_new_privs and a uid that is not 0 no exec can give them back
    _check(libc.capset(ctypes.byref(Header(LINUX_CAPABILITY_VERSION_3, 0)), (Data * 2)()), "capset")


def _serve(source: str, entry_point: str, calls_fd: int, replies_fd: int):
    """The program's process: run the program, then answer calls of entry_point until the pipe closes."""
    try:
        namespace = {"__name__": "__main__"}
        exec(compile(source, "program.py", "exec"), namespace)
        function = namespace[entry_point]
    except BaseException as e:
        _fail(e)  # the runner's next call finds the pipe closed: ProgramEnded
    with os.fdopen(calls_fd, "r") as calls, os.fdopen(replies_fd, "w") as replies:
        for line in calls:
            args, kwargs = _decode(json.loads(line))
            try:
                value = function(*args, **kwargs)
            except BaseException as e:  # SystemExit too: the runner raises it in the test, which then fails
                reply = {"raised": type(e).__name__, "message": str(e)[:500]}
            else:
                try:
                    reply = {"returned": _encode(value)}
                except (TypeError, ValueError, RecursionError):
                    reply = {"not_plain": type(value).__name__}
            replies.write(json.dumps(reply) + "\n")
            replies.flush()
    os._exit(0)


def _remote(entry_point: str, calls, replies):
    """The stand-in for the program's function: each call crosses to the program's process and back."""
    def candidate(*args, **kwargs):
        try:
            calls.write(json.dumps(_encode([list(args), kwargs])) + "\n")
            calls.flush()
        except BrokenPipeError:  # not an OSError a test could catch: the program is gone
            raise ProgramEnded(f"the program's process ended before {entry_point} was called") from None
        line = replies.readline()
        if not line:
            raise ProgramEnded(f"the program's process ended before {entry_point} returned")
        reply = json.loads(line)
        if "returned" in reply:
            return _decode(reply["returned"])
        if "not_plain" in reply:
            raise NotPlainData(f"{entry_point} returned a {reply['not_plain']}, not plain data")
        # the function's exception, raised here as the builtin of that name, so `except ValueError` in a
        # test still works; any other class becomes a RuntimeError
        error = getattr(builtins, reply["raised"], None)
        if not (isinstance(error, type) and issubclass(error, BaseException)):
            raise RuntimeError(f"{reply['raised']}: {reply['message']}")
        raise error(reply["message"])

    candidate.__name__ = entry_point
    return candidate


def _encode(x):
    """Plain data as JSON: scalars as they are, containers as [type name, items]; TypeError for anything else.

    A builtin's subclass (an IntEnum, a namedtuple, a Counter, an int whose __eq__ says yes to
    everything) goes as its base type's value: what its own methods claim stays behind.
    """
    if x is None or type(x) is bool:  # bool has no subclasses
        return x
    for base in (int, float, str):
        if isinstance(x, base):
            return base(x)
    for base in (list, tuple, set, frozenset):
        if isinstance(x, base):
            return [base.__name__, [_encode(v) for v in x]]
    if isinstance(x, dict):
        return ["dict", [[_encode(k), _encode(v)] for k, v in x.items()]]
    if isinstance(x, bytes):
        return ["bytes", bytes(x).hex()]
    if isinstance(x, complex):
        return ["complex", [float(x.real), float(x.imag)]]
    raise TypeError(f"not plain data: {type(x).__name__}")


CONTAINERS = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


def _decode(x):
    """The inverse of _encode, from json.loads output; builds only exact builtin types, whatever it is sent."""
    if type(x) in PLAIN_SCALARS:
        return x
    if type(x) is not list or len(x) != 2:
        raise ValueError(f"not plain data: {str(x)[:100]}")
    kind, body = x
    if kind in CONTAINERS:
        return CONTAINERS[kind](_decode(v) for v in body)
    if kind == "dict":
        return {_decode(k): _decode(v) for k, v in body}
    if kind == "bytes":
        return bytes.fromhex(body)
    if kind == "complex":
        return complex(float(body[0]), float(body[1]))
    raise ValueError(f"unknown plain-data tag {kind!r}")


if __name__ == "__main__":
    _child(sys.argv[1], SandboxLimits(**json.loads(sys.argv[2])))
